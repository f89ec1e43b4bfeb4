"""What a run says as it starts about its checkpoints and its precision, against what a real save writes: one
checkpoint's size from the memory plan's state (qarl.memory.checkpoint_bytes) beside the files of a real
`save_checkpoint`, what `checkpoint.keep` keeps, the files' modes under the user's umask (safetensors creates its own
0600), and the warning of a half-precision run on a CPU."""

from __future__ import annotations

import os

import pytest
import torch

from qarl.checkpoint import save_checkpoint, trainer_state
from qarl.config import load_recipe
from qarl.memory import ModelShape, checkpoint_bytes, plan
from qarl.optim import PolicyOptimizer
from qarl.run import check_run_settings, checkpoint_line, cpu_half_precision_note, disk_size
from tests.conftest import answer_loss, tiny_policy

RECIPE = "recipes/qa_grpo_tiny.yaml"
W4A16 = "quant_configs/nvfp4_a16.yaml"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_checkpoint_size_said_at_start_is_what_a_save_writes(task, tiny_dir, tmp_path, dtype):
    cfg = load_recipe(RECIPE, [f"policy.dtype={dtype}"])
    said = checkpoint_bytes(plan(cfg, ModelShape.of(tiny_dir), 16, False))
    policy = tiny_policy(task, tiny_dir, W4A16, calib_size=16, trainable=True, dtype=dtype)
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    optimizer.backward(answer_loss(policy, task))
    assert optimizer.step().applied  # AdamW's moments exist from the first step on
    checkpoint = save_checkpoint(tmp_path, 1, policy, trainer_state(1, optimizer, 4))
    weights = (checkpoint / "policy" / "model.safetensors").stat().st_size  # fp32 masters, whatever the compute dtype
    state = (checkpoint / "trainer_state.pt").stat().st_size
    assert said["weights"] <= weights <= said["weights"] * 1.01 + 16_384  # + the safetensors header
    assert said["AdamW state"] <= state <= said["AdamW state"] * 1.01 + 65_536  # + RNG states, pickling
    whole = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert whole <= sum(said.values()) * 1.01 + 131_072  # the amax, the tokenizer, the config: little


def test_the_start_up_line_says_what_checkpoint_keep_keeps(tiny_dir):
    cfg = load_recipe(RECIPE, ["trainer.steps=10", "checkpoint.every=4", "checkpoint.keep=2"])
    memory = plan(cfg, ModelShape.of(tiny_dir), 16, False)
    one = sum(checkpoint_bytes(memory).values())
    line = checkpoint_line(cfg, memory)  # steps 4, 8 and 10 are saved
    assert line.startswith(f"checkpoints: ~{disk_size(one)} each (weights ")
    assert f"every 4 steps; checkpoint.keep=2 keeps 2: up to {disk_size(3 * one)} in runs/qa_grpo_tiny/checkpoints" in line
    every = checkpoint_line(load_recipe(RECIPE, ["trainer.steps=10", "checkpoint.every=4", "checkpoint.keep=0"]), memory)
    assert f"checkpoint.keep=0 keeps 3: up to {disk_size(3 * one)}" in every
    lora = load_recipe("recipes/qlora_grpo_tiny.yaml")
    assert "LoRA adapters" in checkpoint_line(lora, plan(lora, ModelShape.of(tiny_dir), 16, False))
    assert (disk_size(1.6e9), disk_size(4.9e6)) == ("1.60 GB", "4.9 MB")


def test_checkpoints_and_exports_take_the_users_umask(task, tiny_dir, tmp_path):
    from qarl.export import export_policy

    policy = tiny_policy(task, tiny_dir, W4A16, calib_size=16)
    old = os.umask(0o027)
    try:
        checkpoint = save_checkpoint(tmp_path / "run", 1, policy, {"step": 1})
        export_policy(policy, "export/nvfp4_w4a16_modelopt.yaml", tmp_path / "export")
    finally:
        os.umask(old)
    files = [p for root in (checkpoint, tmp_path / "export") for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "quantizer_state.safetensors", "trainer_state.pt"}
    assert {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files} == {
        p.relative_to(tmp_path).as_posix(): oct(0o640) for p in files}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's warning")
def test_a_half_precision_run_on_a_cpu_is_warned_once_as_it_starts(capsys):
    check_run_settings(load_recipe(RECIPE, ["policy.dtype=bfloat16"]))
    out = capsys.readouterr().out
    assert out.count("warning: policy.dtype=bfloat16 on a CPU: the train/rollout parity measured in float32") == 1
    assert "use policy.dtype=float32" in out
    check_run_settings(load_recipe(RECIPE))
    assert "warning" not in capsys.readouterr().out
    assert cpu_half_precision_note("float16", gpu=False).startswith("warning: policy.dtype=float16 on a CPU")
    assert cpu_half_precision_note("bfloat16", gpu=True) is None
