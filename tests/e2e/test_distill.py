"""QAD's own end-to-end checks (real vLLM, real ModelOpt, in subprocesses): a qarl checkpoint serves as a teacher,
and QAD trains a QLoRA adapter over the frozen quantized student (`-m slow`). What QAD shares with GRPO (a few
steps, exact resume after SIGKILL): tests/e2e/test_loops.py; its loss and input checks: tests/unit/test_distill_loss.py,
tests/unit/test_loop_checks.py."""

from __future__ import annotations

import math
import subprocess

import pytest

from qarl.config import RecipeConfig, load_recipe
from qarl.distill import teacher_source
from qarl.metrics import read_metrics
from tests.loops import QAD


def test_a_qarl_checkpoint_is_a_teacher(loop_runs, tmp_path):
    run_dir = loop_runs.resumed(QAD)
    cfg = load_recipe(QAD.recipe, [f"run.dir={tmp_path / 'run'}", f"teacher.model_name={run_dir}"], RecipeConfig)
    assert teacher_source(cfg) == str(run_dir / "checkpoints" / "step_3" / "policy")


@pytest.mark.slow  # QLoRA runs and refits: tests/e2e/test_lora_runs.py; QAD's loop: tests/e2e/test_loops.py
def test_qad_trains_a_qlora_adapter_over_the_frozen_quantized_student(tmp_path):
    """QAD with policy.lora: only the adapter learns (the checkpoint is an adapter on the warm-started
    base), the engine serves it (mismatch at the floor), and the KL is finite at every step."""
    from safetensors.torch import load_file

    run = tmp_path / "qlora"  # in a subprocess, as the other runs: an engine torn down in-process breaks later ones
    subprocess.run(QAD.command(run, "policy.lora.mode=qlora", "trainer.lr=3.0e-3", "checkpoint.every=3"),
                   check=True, timeout=600)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[:3]:
        assert math.isfinite(r["distill/kl"]) and abs(r["mismatch/kl"]) < 1e-4
    checkpoint = run / "checkpoints" / "step_3"
    assert (checkpoint / "lora.json").is_file() and not (checkpoint / "policy").exists()
    adapter = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B starts at 0


def test_a_qa_grpo_run_goes_on_from_a_qad_checkpoint_with_its_amax(loop_runs, tmp_path):
    """A two-stage recipe (QAD, then QA-GRPO) is a run whose policy.model_name is the first stage's run: its step-0
    policy is that checkpoint's master weights with that checkpoint's calibrated amax (the same format), not weights
    calibrated afresh; in another format its quantizers are calibrated afresh, and it says so. The run then trains."""
    import torch
    from safetensors.torch import load_file

    from qarl.quant.quantize import quantizer_state
    from qarl.run import initial_policy
    from qarl.tasks import build_task
    from tests.loops import GRPO

    qad_run = loop_runs.resumed(QAD)
    checkpoint = qad_run / "checkpoints" / "step_3"
    start = [f"policy.model_name={qad_run}", "policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml", "warm_start.enabled=false"]
    cfg = load_recipe(GRPO.recipe, [f"run.dir={tmp_path / 'rl'}", *start], RecipeConfig)
    policy = initial_policy(cfg, build_task(cfg.task, cfg.run.seed), trainable=False)
    saved = load_file(str(checkpoint / "quantizer_state.safetensors"))
    state = quantizer_state(policy.model)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    weights = load_file(str(checkpoint / "policy" / "model.safetensors"))
    master = policy.master_state_dict()
    assert all(torch.equal(master[k].float(), weights[k].float()) for k in weights if k in master)

    proc = subprocess.run(GRPO.command(tmp_path / "rl", *start, "trainer.steps=1", "eval.every=0"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"starting from checkpoint {checkpoint}: its weights and its calibrated amax" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "rl" / "metrics.jsonl")] == [0]

    other = load_recipe(GRPO.recipe, [f"run.dir={tmp_path / 'w4a16'}", f"policy.model_name={qad_run}",
                                      "warm_start.enabled=false"], RecipeConfig)
    from qarl.run import _starts_with_its_amax, resolve_recipe
    assert not _starts_with_its_amax(checkpoint, other, resolve_recipe(other).policy_format)
