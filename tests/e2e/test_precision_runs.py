"""Mixed precision end to end with real vLLM in subprocesses (QA-GRPO, tests/loops.py's few steps): bf16/fp16 compute
with fp32 masters trains without NaN and writes the optional metric loggers, a diverging run stops naming the setting,
and FP8 rollouts of a full-precision policy. The same pieces in process: tests/unit/test_precision.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.checkpoint import complete_checkpoints, load_policy_checkpoint
from qarl.config import GenerationConfig, PolicyConfig
from qarl.metrics import read_metrics
from qarl.policy import build_policy
from tests.conftest import tiny_policy
from tests.loops import GRPO


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = GRPO.command(run_dir, *extra)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # never the network
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


# fp16's loss scaling in the optimizer: tests/unit/test_precision.py (in the default suite)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_low_precision_compute_with_fp32_masters_trains_without_nan(tmp_path, dtype):
    proc = _run(tmp_path / dtype, f"policy.dtype={dtype}", "run.loggers=[tensorboard,wandb]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(tmp_path / dtype / "metrics.jsonl")
    steps = [r for r in rows if r.get("reward/mean") is not None]
    assert len(steps) == 4 and all(r["loss"] is not None and r["grad_norm"] is not None for r in steps)
    assert all(r["train/skipped"] == 0 for r in steps)
    assert all(r["mismatch/kl"] is not None for r in steps)
    assert ("train/loss_scale" in steps[0]) == (dtype == "float16")
    checkpoint = complete_checkpoints(tmp_path / dtype)[-1]
    saved = load_file(str(checkpoint / "policy" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())  # the masters, not the bf16/fp16 copy
    resumed = load_policy_checkpoint(checkpoint, PolicyConfig(dtype=dtype), trainable=True)
    assert resumed.model.dtype == getattr(torch, dtype) and resumed.master is not None
    events = list((tmp_path / dtype / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "tensorboard logger wrote nothing"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(events[0].parent)).Reload().Scalars("reward/mean")
    assert [s.value for s in scalars] == pytest.approx([r["reward/mean"] for r in steps])
    wandb_runs = list((tmp_path / dtype / "wandb").glob("offline-run-*/run-*.wandb"))  # offline: a local file
    assert len(wandb_runs) == 1 and wandb_runs[0].stat().st_size > 1000


def test_a_diverging_run_stops_with_an_error_naming_the_setting(tmp_path):
    run_dir = tmp_path / "diverges"
    proc = _run(run_dir, "trainer.lr=1e30", "checkpoint.every=1", "trainer.max_nonfinite_steps=2")
    assert proc.returncode == 1
    assert "trainer.max_nonfinite_steps=2" in proc.stderr and "Traceback" not in proc.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["train/nonfinite"] for r in rows] == [0, 1, 1]  # step 0 applied (and blew the weights up)
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_1", "step_2"]  # none after the stop
    load_policy_checkpoint(run_dir, PolicyConfig())  # what was written stays loadable


def test_quantized_rollouts_of_a_full_precision_policy(task, tiny_dir, tmp_path):
    """policy.quant_cfg=none with FP8 rollouts: the engine is refitted from a RolloutView, the policy's
    current weights quantized and freshly calibrated in FP8 at every refit; end to end it trains and
    reports the mismatch that synced QA-GRPO does not have."""
    from qarl.policy import attach_rollout_view
    from qarl.quant import quantizer_state

    cfg = PolicyConfig(quant_cfg="none", quant_calib_size=16,
                       generation=GenerationConfig(quant_cfg="fp8_w8a8", allow_quant_mismatch=True))
    texts = task.calibration_texts(16)
    torch.manual_seed(0)
    policy = build_policy(cfg, texts, model_dir=tiny_dir, trainable=True)
    attach_rollout_view(policy, cfg, texts)
    assert policy.rollout is not None
    with torch.no_grad():
        policy.model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)  # the policy moved
    rollout = policy.rollout_model()
    fresh = tiny_policy(task, tiny_dir, "fp8_w8a8", calib_size=16)
    with torch.no_grad():
        fresh.model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    from qarl.quant.quantize import calibrate

    calibrate(fresh.model, fresh.format, policy.rollout.batches)
    assert torch.equal(rollout.model.layers[0].self_attn.q_proj.weight, policy.model.model.layers[0].self_attn.q_proj.weight)
    expected, got = quantizer_state(fresh.model), quantizer_state(rollout)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    proc = _run(tmp_path / "fp8_rollouts", "policy.quant_cfg=none", "policy.generation.quant_cfg=fp8_w8a8",
                "policy.generation.allow_quant_mismatch=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in read_metrics(tmp_path / "fp8_rollouts" / "metrics.jsonl") if r.get("mismatch/kl") is not None]
    assert len(rows) == 4 and min(r["mismatch/kl"] for r in rows) > 1e-6  # synced runs sit at ~1e-10
