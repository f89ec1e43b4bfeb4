"""The `qarl` command.

  qarl train RECIPE [a.b=c ...]            QA-GRPO (GRPO with policy.quant_cfg=none)
  qarl distill RECIPE [a.b=c ...]          on-policy QAD: quantized student, full-precision teacher
  qarl eval CHECKPOINT_OR_MODEL [a.b=c ...]  held-out accuracy, quantized and unquantized (JSON)
  qarl parity RECIPE [a.b=c ...] [--json]  train/rollout log-prob mismatch per quant format
  qarl matrix RECIPE [a.b=c ...]           accuracy of models x precisions vs PTQ: gain survival, SEs
  qarl diagnose MODEL [MODEL ...] [--recipe R] [--out DIR]  per-layer quantizability, before vs after training
  qarl export CHECKPOINT --target export/T.yaml --out DIR   real NVFP4/FP8 Hugging Face checkpoint
  qarl export --verify DIR                 load an export independently and compare its logits

Tensor and data parallel (the Megatron backend), N processes, N / TP data-parallel ranks:
  torchrun --nproc_per_node N -m qarl train RECIPE policy.backend=megatron policy.tensor_parallel_size=TP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from qarl.config import ConfigError, RecipeConfig, TrainingDiverged, load_recipe
from qarl.rewards import RewardError


def _parity(args: argparse.Namespace) -> int:
    from qarl.parity import format_table, run_parity

    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    with contextlib.redirect_stdout(sys.stderr):  # libraries print progress; stdout carries the result
        results = run_parity(cfg)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def _train(args: argparse.Namespace) -> int:
    from qarl.train import train

    train(load_recipe(args.recipe, args.overrides, RecipeConfig))
    return 0


def _distill(args: argparse.Namespace) -> int:
    from qarl.distill import distill

    distill(load_recipe(args.recipe, args.overrides, RecipeConfig))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from qarl.evaluate import run_eval

    with contextlib.redirect_stdout(sys.stderr):
        results = run_eval(args.target, args.overrides)
    print(json.dumps(results, indent=2))
    return 0


def _matrix(args: argparse.Namespace) -> int:
    from qarl.matrix import markdown, run_matrix

    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    with contextlib.redirect_stdout(sys.stderr):
        report, out = run_matrix(cfg)
    print(markdown(report))
    print(f"\n{out}/matrix.json, matrix.md, matrix.png ({report['seconds']:.0f} s)")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from qarl.diagnose import markdown, run_diagnose

    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    with contextlib.redirect_stdout(sys.stderr):
        report = run_diagnose(cfg, args.models, Path(args.out))
    print(markdown(report))
    print(f"\n{args.out}/diagnose.json, diagnose.md, diagnose.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qarl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    parity = sub.add_parser("parity", help="train/rollout log-prob mismatch per quantization format")
    parity.add_argument("recipe")
    parity.add_argument("overrides", nargs="*", help="a.b=c recipe overrides")
    parity.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parity.set_defaults(func=_parity)
    train = sub.add_parser("train", help="QA-GRPO (or GRPO with policy.quant_cfg=none) from a recipe")
    train.add_argument("recipe")
    train.add_argument("overrides", nargs="*", help="a.b=c recipe overrides, e.g. run.dir=runs/x trainer.resume=true")
    train.set_defaults(func=_train)
    evaluate = sub.add_parser("eval", help="held-out accuracy of a checkpoint or model, quantized and not, as JSON")
    evaluate.add_argument("target", help="a checkpoint, a run directory (newest checkpoint) or a model")
    evaluate.add_argument("overrides", nargs="*", help="a.b=c recipe overrides")
    evaluate.set_defaults(func=_eval)
    distill = sub.add_parser("distill", help="on-policy quantization-aware distillation (QAD) from a "
                                             "full-precision teacher, from a recipe")
    distill.add_argument("recipe")
    distill.add_argument("overrides", nargs="*",
                         help="a.b=c recipe overrides, e.g. teacher.model_name=DIR distill.top_k=64")
    distill.set_defaults(func=_distill)
    matrix = sub.add_parser("matrix", help="held-out accuracy of models x precisions (full, PTQ methods, trained "
                                           "quantization): gain over the base and its survival, with SEs")
    matrix.add_argument("recipe", help="a recipe with a matrix: section, e.g. recipes/matrix_tiny.yaml")
    matrix.add_argument("overrides", nargs="*", help="a.b=c recipe overrides, e.g. matrix.num_prompts=2000")
    matrix.set_defaults(func=_matrix)
    diagnose = sub.add_parser("diagnose", help="per-layer quantizability (kurtosis, outliers, NVFP4/FP8 errors of "
                                               "weights, inputs and outputs) of models, compared layer by layer")
    diagnose.add_argument("models", nargs="+", help="qarl runs, checkpoints, Hugging Face model directories, or "
                                                    "warm-start (the recipe's step-0 model); the first is the reference")
    diagnose.add_argument("--recipe", default=str(Path(__file__).parent / "recipe_defaults.yaml"),
                          help="the recipe whose task gives the calibration data (default: the embedded task)")
    diagnose.add_argument("--set", dest="overrides", nargs="*", default=[], help="a.b=c recipe overrides")
    diagnose.add_argument("--out", default="runs/diagnose", help="where diagnose.json/.md/.png go")
    diagnose.set_defaults(func=_diagnose)
    from qarl.export.cli import add_export_command  # argparse only: the export itself is imported when run

    add_export_command(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"qarl: error: {e}", file=sys.stderr)
        return 2
    except (RewardError, TrainingDiverged) as e:
        print(f"qarl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
