"""The `qarl` command.

  qarl train RECIPE [a.b=c ...]            QA-GRPO (GRPO with policy.quant_cfg=none)
  qarl distill RECIPE [a.b=c ...]          on-policy QAD: quantized student, full-precision teacher
  qarl eval CHECKPOINT_OR_MODEL [a.b=c ...]  held-out accuracy, quantized and unquantized (JSON)
  qarl parity RECIPE [a.b=c ...] [--json]  train/rollout log-prob mismatch per quant format
  qarl matrix RECIPE [a.b=c ...]           accuracy of models x precisions vs PTQ: gain survival, SEs
  qarl diagnose RECIPE MODEL [MODEL ...] [a.b=c ...] [--out DIR]  per-layer quantizability, before vs after
  qarl export CHECKPOINT --target export/T.yaml --out DIR   real NVFP4/FP8 Hugging Face checkpoint
  qarl export --verify DIR                 load an export independently and compare its logits
  qarl config RECIPE [a.b=c ...]           the resolved recipe, every default filled in
  qarl config --schema [--markdown]        every recipe key: type, default, allowed values, meaning

Tensor and data parallel (the Megatron backend), N processes, N / TP data-parallel ranks:
  torchrun --nproc_per_node N -m qarl train RECIPE policy.backend=megatron policy.tensor_parallel_size=TP

Every command loads and checks its recipe (and run.dir) before it imports torch, vLLM or ModelOpt: a bad setting
is answered in about a second. Third-party warnings and notices (ModelOpt's, vLLM's) are hidden; -v shows them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import warnings
from pathlib import Path

from qarl import __version__
from qarl.config import (WARM_START, ConfigError, NoLearningSignal, RecipeConfig, TrainingDiverged,
                         check_grpo_recipe, check_qad_recipe, load_recipe, to_dict)
from qarl.console import set_verbose
from qarl.models.resolve import check_model_name
from qarl.outputs import check_outputs
from qarl.quant_cfg import check_quant_files
from qarl.rewards import RewardError, WeightedRewards
from qarl.tasks import sample_answer
from qarl.tasks.dataset import check_calibration_file, check_data_files

# Warnings third-party libraries print as they import, about their own optional parts, that a user cannot act on.
QUIET_MODULES = r"(megatron|modelopt|vllm|torch\.distributed|transformers)(\..*)?"


def quiet_third_party() -> None:
    """Hide the import-time warnings of QUIET_MODULES (Apex or Transformer Engine missing, untested version pairs,
    deprecations inside vLLM); qarl's own warnings and every error still show."""
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=QUIET_MODULES)
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of modelopt")


def _recipe(args: argparse.Namespace) -> RecipeConfig:
    """The command's recipe, and the files, names, paths and rewards it points to that can be checked without torch:
    its data read whole, its rewards imported and called once on a sample, where it writes tried."""
    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    check_quant_files(cfg)
    check_data_files(cfg.task)
    check_calibration_file(cfg.policy.quant_calib_data)
    check_model_name(cfg.policy.model_name, "policy.model_name")
    if args.command == "distill" and cfg.teacher.model_name != WARM_START:
        check_model_name(cfg.teacher.model_name, "teacher.model_name")
    check_outputs(cfg, args.command)
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)
    rewards.check_on_sample(sample_answer(cfg.task, cfg.run.seed))
    return cfg


def _training_recipe(args: argparse.Namespace, loop_checks) -> RecipeConfig:
    """A training command's recipe, the loop's own checks of it, and what it may do with run.dir (locked first, for
    the life of the process: no other run may write there meanwhile), before anything heavy."""
    from qarl.run_dir import own_run_dir, plan_run_dir

    cfg = _recipe(args)
    loop_checks(cfg)
    own_run_dir(cfg.run.dir, cfg.trainer.resume, cfg.run.overwrite)
    plan_run_dir(cfg.run.dir, cfg.trainer.resume, cfg.run.overwrite)
    return cfg


def _parity(args: argparse.Namespace) -> int:
    cfg = _recipe(args)
    from qarl.parity import format_table, run_parity

    with contextlib.redirect_stdout(sys.stderr):  # libraries print progress; stdout carries the result
        results = run_parity(cfg)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def _train(args: argparse.Namespace) -> int:
    cfg = _training_recipe(args, check_grpo_recipe)
    from qarl.train import train

    train(cfg)
    return 0


def _distill(args: argparse.Namespace) -> int:
    cfg = _training_recipe(args, check_qad_recipe)
    from qarl.distill import distill

    distill(cfg)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from qarl.evaluate import run_eval

    with contextlib.redirect_stdout(sys.stderr):
        results = run_eval(args.target, args.overrides)
    print(json.dumps(results, indent=2))
    return 0


def _matrix(args: argparse.Namespace) -> int:
    cfg = _recipe(args)
    from qarl.matrix import markdown, run_matrix

    with contextlib.redirect_stdout(sys.stderr):
        report, out = run_matrix(cfg)
    print(markdown(report))
    print(f"\n{out}/matrix.json, matrix.md, matrix.png ({report['seconds']:.0f} s)")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    models = [a for a in args.models if "=" not in a]
    overrides = [a for a in args.models if "=" in a]
    if not models:
        raise ConfigError("qarl diagnose RECIPE MODEL [MODEL ...]: name at least one model after the recipe")
    cfg = load_recipe(args.recipe, overrides, RecipeConfig)
    from qarl.diagnose import markdown, run_diagnose

    with contextlib.redirect_stdout(sys.stderr):
        report = run_diagnose(cfg, models, Path(args.out), args.also)
    print(markdown(report))
    print(f"\n{args.out}/diagnose.json, diagnose.md, diagnose.png")
    return 0


def _config(args: argparse.Namespace) -> int:
    from qarl import config_schema

    if args.schema:
        print(config_schema.markdown() if args.markdown else config_schema.text())
        return 0
    if args.recipe is None:
        raise ConfigError("qarl config RECIPE [a.b=c ...] prints a recipe resolved; qarl config --schema lists every key")
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(to_dict(_recipe(args))), end="")
    return 0


def _with_recipe(sub: argparse._SubParsersAction, name: str, help: str, func, overrides_help: str = "a.b=c recipe "
                 "overrides") -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help)
    parser.add_argument("recipe", help="a recipe YAML file, e.g. recipes/qa_grpo_tiny.yaml")
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qarl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"qarl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show third-party libraries' warnings and notices (ModelOpt, vLLM, torch)")
    sub = parser.add_subparsers(dest="command", required=True)
    parity = _with_recipe(sub, "parity", "train/rollout log-prob mismatch per quantization format", _parity)
    parity.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _with_recipe(sub, "train", "QA-GRPO (or GRPO with policy.quant_cfg=none) from a recipe", _train,
                 "a.b=c recipe overrides, e.g. run.dir=runs/x trainer.resume=true")
    evaluate = sub.add_parser("eval", help="held-out accuracy of a checkpoint or model, quantized and not, as JSON")
    evaluate.add_argument("target", help="a checkpoint, a run directory (newest checkpoint) or a model")
    evaluate.add_argument("overrides", nargs="*", help="a.b=c recipe overrides")
    evaluate.set_defaults(func=_eval)
    _with_recipe(sub, "distill", "on-policy quantization-aware distillation (QAD) from a full-precision teacher, "
                 "from a recipe", _distill, "a.b=c recipe overrides, e.g. teacher.model_name=DIR distill.top_k=64")
    _with_recipe(sub, "matrix", "held-out accuracy of models x precisions (full, PTQ methods, trained quantization): "
                 "gain over the base and its survival, with SEs", _matrix,
                 "a.b=c recipe overrides, e.g. matrix.num_prompts=2000")
    diagnose = sub.add_parser("diagnose", help="per-layer quantizability (kurtosis, outliers, NVFP4/FP8 errors of "
                                               "weights, inputs and outputs) of models, compared layer by layer")
    diagnose.add_argument("recipe", help="the recipe whose task gives the calibration data, e.g. "
                                         "qarl/recipe_defaults.yaml for the embedded task")
    diagnose.add_argument("models", nargs="+", metavar="MODEL_OR_OVERRIDE",
                          help="qarl runs, checkpoints, Hugging Face model directories, or warm-start (the recipe's "
                               "step-0 model), the first the reference; then a.b=c recipe overrides")
    diagnose.add_argument("--out", default="runs/diagnose", help="where diagnose.json/.md/.png go")
    diagnose.add_argument("--also", nargs="+", default=[], metavar="QUANT_CFG",
                          help="more formats whose weight, input and output errors are reported beside NVFP4 "
                               "W4A4's, e.g. quant_configs/nvfp4_w4a4_per_token.yaml")
    diagnose.set_defaults(func=_diagnose)
    config = sub.add_parser("config", help="print a recipe resolved (every default filled in), or every key's "
                                           "type, default, allowed values and meaning (--schema)")
    config.add_argument("recipe", nargs="?", help="a recipe YAML file")
    config.add_argument("overrides", nargs="*", help="a.b=c recipe overrides")
    config.add_argument("--schema", action="store_true", help="every recipe key instead of one recipe")
    config.add_argument("--markdown", action="store_true", help="with --schema: as the docs' Markdown page")
    config.set_defaults(func=_config)
    from qarl.export.cli import add_export_command  # argparse only: the export itself is imported when run

    add_export_command(sub)
    return parser


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C leaves to say: for a training command, the run's last complete checkpoint and the command that
    continues from it (the same recipe and overrides, with run.dir and trainer.resume=true)."""
    try:
        cfg = load_recipe(args.recipe, args.overrides, RecipeConfig) if args.command in ("train", "distill") else None
    except ConfigError:  # stopped while the recipe was read
        cfg = None
    if cfg is None:
        return "interrupted (Ctrl-C)"
    from qarl.run_dir import complete_checkpoints, newest_intact, read_identity

    run_dir = Path(cfg.run.dir)
    how_started = ("run.dir", "trainer.resume", "run.overwrite")
    kept = [o for o in args.overrides if o.split("=", 1)[0].strip() not in how_started]
    command = shlex.join(["qarl", args.command, args.recipe, f"run.dir={run_dir}", *kept])
    try:
        checkpoints = complete_checkpoints(run_dir, (read_identity(run_dir) or {}).get("run_id"))
    except ConfigError:  # the run's identity file damaged: the resume will say so
        checkpoints = []
    last = newest_intact(checkpoints, hashes=False)[0]  # (sizes only: a quick word, not a second verification)
    if last is None:
        return (f"interrupted (Ctrl-C) before the first checkpoint in {run_dir}: nothing to resume; start again with "
                f"`{command} run.overwrite=true`")
    return (f"interrupted (Ctrl-C); the last complete checkpoint is {last.name} in {run_dir}: continue "
            f"with `{command} trainer.resume=true`")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_verbose(args.verbose)
    if not args.verbose:
        quiet_third_party()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"qarl: error: {e}", file=sys.stderr)
        return 2
    except (RewardError, TrainingDiverged, NoLearningSignal) as e:
        print(f"qarl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nqarl: error: {interrupted(args)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
