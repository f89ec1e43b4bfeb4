"""QA-GRPO end to end on the embedded default (real vLLM, real ModelOpt), in subprocesses: a few
steps, exact resume after SIGKILL, a reward that raises, and the input checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qarl.checkpoint import complete_checkpoints, load_policy_checkpoint
from qarl.config import ConfigError, PolicyConfig, RecipeConfig, load_recipe
from qarl.metrics import read_metrics

SMALL = ["trainer.steps=4", "trainer.batch_size=16", "trainer.num_generations=4", "warm_start.steps=30",
         "checkpoint.every=2", "eval.every=2", "eval.num_prompts=16", "task.num_train=200", "task.num_eval=16",
         "policy.quant_calib_size=16", "policy.generation.max_new_tokens=4"]


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "qarl", "train", "recipes/qa_grpo_tiny.yaml", f"run.dir={run_dir}", *SMALL, *extra]


def _deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(_train_cmd(run_dir), check=True, timeout=600)
    return run_dir


def test_a_few_steps_write_metrics_checkpoints_and_plot(uninterrupted):
    rows = read_metrics(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    required = ["reward/mean", "reward/std", "reward/frac_zero_std", "kl/ref", "entropy", "mismatch/kl",
                "mismatch/max_abs_logprob_diff", "perf/rollout_tokens_per_s", "perf/step_s"]
    assert all(k in rows[1] for k in required)
    assert all(r.get("eval/accuracy") is not None for r in rows if r["step"] % 2 == 0)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows[:4]) < 1e-4  # synced: at the fp32 floor
    assert (uninterrupted / "metrics.png").stat().st_size > 10_000
    checkpoints = complete_checkpoints(uninterrupted)
    assert [c.name for c in checkpoints] == ["step_2", "step_4"]
    from transformers import AutoModelForCausalLM  # an ordinary Hugging Face directory

    AutoModelForCausalLM.from_pretrained(checkpoints[-1] / "policy")
    policy = load_policy_checkpoint(uninterrupted, PolicyConfig())
    assert policy.format is not None and policy.format.name == "nvfp4_a16"


def kill_after_first_checkpoint(cmd: list[str], run_dir: Path) -> None:
    """Start a training command and SIGKILL it (its whole process group) once checkpoint step_2 is complete."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # in the middle of step 2
    proc.wait()


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(uninterrupted, tmp_path):
    run_dir = tmp_path / "killed"
    kill_after_first_checkpoint(_train_cmd(run_dir), run_dir)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    subprocess.run(_train_cmd(run_dir, "trainer.resume=true"), check=True, timeout=600)
    resumed = _deterministic(read_metrics(run_dir / "metrics.jsonl"))
    assert resumed == _deterministic(read_metrics(uninterrupted / "metrics.jsonl"))


def test_a_reward_that_raises_stops_the_run_and_keeps_its_checkpoints(tmp_path):
    run_dir = tmp_path / "raises"
    env = {**os.environ, "QARL_TEST_RAISE_AFTER_CALLS": "3"}
    proc = subprocess.run(_train_cmd(run_dir, "trainer.rewards=[{name: tests.rewards_for_tests:raises_later}]"),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "raises_later" in proc.stderr and "reward_error=zero" in proc.stderr
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_2"]
    load_policy_checkpoint(run_dir, PolicyConfig())  # intact and loadable


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.rewards=[{name: no_such_reward}]"], "unknown reward"),
    (["trainer.num_generations=1"], "at least 2"),
    (["trainer.batch_size=10", "trainer.num_generations=4"], "not divisible"),
    (["policy.generation.quant_cfg=fp8_w8a8"], "allow_quant_mismatch"),
    (["task.name=dataset", "task.train_data=MISSING.jsonl", "task.eval_data=MISSING.jsonl"], "not found"),
    (["policy.master_dtype=float16", "policy.dtype=float16"], "cannot train"),
    (["policy.dtype=bfloat16", "policy.master_dtype=bfloat16", "policy.dtype=float32"], "narrower"),
    (["policy.dtype=int8"], "choose one of"),
    (["run.loggers=[nope]"], "unknown logger"),
    (["policy.backend=nope"], "choose one of"),
    (["policy.tensor_parallel_size=2"], "needs policy.backend=megatron"),
    (["policy.backend=megatron", "policy.lora.mode=qlora"], "trains whole models"),
    (["policy.backend=megatron", "policy.tensor_parallel_size=2"], "a multiple of 2"),
    (["policy.backend=megatron", "policy.generation.quant_cfg=fp8_w8a8", "policy.generation.allow_quant_mismatch=true"],
     "policy's own format"),
    pytest.param(["policy.generation.sleep_between_rollouts=on"], "needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="allowed where CUDA is")),
])
def test_bad_input_fails_before_any_model_is_loaded(tmp_path, monkeypatch, overrides, needle):
    import qarl.run
    from qarl.train import train

    def tripwire(*args, **kwargs):
        raise AssertionError("a model or engine was loaded before the input was checked")

    monkeypatch.setattr(qarl.run, "initial_policy", tripwire)
    monkeypatch.setattr(qarl.run, "load_policy_checkpoint", tripwire)
    monkeypatch.setattr(qarl.run, "VLLMEngine", tripwire)
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [f"run.dir={tmp_path}", *overrides], RecipeConfig)
    with pytest.raises(ConfigError, match=needle):
        train(cfg)


def test_dataset_without_the_answer_column_is_named(tmp_path):
    from qarl.train import train

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "solution": "2"}) + "\n")
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [f"run.dir={tmp_path}", "task.name=dataset",
                                                    f"task.train_data={data}", f"task.eval_data={data}"], RecipeConfig)
    with pytest.raises(ConfigError, match="no column 'answer'"):
        train(cfg)


def test_eval_reports_quantized_and_unquantized_accuracy(uninterrupted):
    out = subprocess.run([sys.executable, "-m", "qarl", "eval", str(uninterrupted)], check=True, capture_output=True,
                         text=True, timeout=600).stdout
    result = json.loads(out)
    assert result["format"] == "nvfp4_a16" and result["num_prompts"] == 16
    assert 0.0 <= result["quantized"] <= 1.0 and 0.0 <= result["unquantized"] <= 1.0
    final = read_metrics(uninterrupted / "metrics.jsonl")[-1]
    assert result["quantized"] == final["eval/accuracy"]  # the same greedy evaluation as the training run's
