"""Mixed precision (fp32 master weights, bf16/fp16 compute, fp16 loss scaling) and the non-finite guard, on the
real tiny policy in process. The same end to end, with the metric loggers: tests/e2e/test_precision_runs.py."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig, PolicyConfig, TrainingDiverged
from qarl.optim import LossScaler, NonFiniteGuard, PolicyOptimizer, StepResult, step_groups
from qarl.policy import build_policy
from tests.conftest import answer_loss, tiny_policy


def _policy(task, tiny_dir, dtype: str):
    return tiny_policy(task, tiny_dir, "nvfp4_a16", calib_size=16, trainable=True, dtype=dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_planted_nan_loss_is_skipped_and_the_next_step_applies(task, tiny_dir, dtype):
    policy = _policy(task, tiny_dir, dtype)
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    before = {n: m.clone() for n, m in policy.master.items()}
    weights = [p.detach().clone() for p in policy.model.parameters()]
    optimizer.backward(answer_loss(policy, task, scale=float("nan")))
    result = optimizer.step()
    assert not result.applied and result.nonfinite
    assert all(torch.equal(before[n], m) for n, m in policy.master.items())
    assert all(torch.equal(w, p) for w, p in zip(weights, policy.model.parameters()))
    for _ in range(8):  # fp16: overflows first lower the loss scale until the gradient fits
        optimizer.backward(answer_loss(policy, task))
        result = optimizer.step()
        assert not result.nonfinite
        if result.applied:
            break
    assert result.applied and result.grad_norm > 0
    assert not all(torch.equal(before[n], m) for n, m in policy.master.items())


def test_stepping_the_masters_in_groups_is_the_one_step_bit_for_bit(task, tiny_dir):
    """AdamW's multi-tensor temporaries are bounded by stepping groups of masters one after another; each tensor's
    update is its own, so one tensor a group ends where one group of all of them does: masters, moments, weights."""
    assert step_groups([5, 5, 20, 1, 1, 9], 10) == [[0, 1], [2], [3, 4], [5]]
    assert step_groups([0, 3], 10) == [[0, 1]] and step_groups([], 10) == []
    ends = []
    for grouped in (False, True):
        policy = _policy(task, tiny_dir, "bfloat16")
        optimizer = PolicyOptimizer(policy, 1e-2, 0.1, 0.5)  # clipping and weight decay on
        optimizer.step_groups = ([[i] for i in range(len(optimizer.masters))] if grouped
                                 else [list(range(len(optimizer.masters)))])
        for _ in range(3):
            optimizer.backward(answer_loss(policy, task))
            assert optimizer.step().applied
        state = optimizer.optimizer.state
        ends.append(([m.clone() for m in optimizer.masters], [p.detach().clone() for p in policy.model.parameters()],
                     [state[m][k].clone() for m in optimizer.masters for k in ("exp_avg", "exp_avg_sq", "step")]))
    assert len(ends[1][0]) > 10
    for one, grouped in zip(*ends):
        assert all(torch.equal(a, b) for a, b in zip(one, grouped))


def test_fp16_overflow_lowers_the_loss_scale_without_counting_as_nonfinite(task, tiny_dir):
    policy = _policy(task, tiny_dir, "float16")
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    assert optimizer.scaler is not None and optimizer.scaler.scale == 2.0**16
    optimizer.backward(answer_loss(policy, task, scale=1e4))  # x 65536 overflows fp16 gradients
    result = optimizer.step()
    assert not result.applied and not result.nonfinite and result.loss_scale == 2.0**15
    scaler = LossScaler(scale=4.0, growth_interval=2)
    for overflow in (False, False, True):
        scaler.update(overflow)
    assert scaler.scale == 4.0  # doubled after 2 clean steps, halved by the overflow


def test_guard_stops_after_the_limit_in_a_row():
    guard = NonFiniteGuard(limit=2)
    guard(True, 1)
    guard(False, 2)  # a clean step resets the count
    guard(True, 3)
    with pytest.raises(TrainingDiverged, match="trainer.max_nonfinite_steps=2"):
        guard(True, 4)
    assert guard.total == 3
    assert StepResult(applied=True, nonfinite=False, grad_norm=1.0, loss_scale=None).applied


def test_rollouts_in_another_format_start_from_the_masters(task, tiny_dir):
    """A bf16 NVFP4 policy (fp32 masters: its compute weights hold their NVFP4 values after a step) with FP8
    rollouts: the rollout view takes the masters' rounding, never the policy's quantized weights."""
    from qarl.optim import PolicyOptimizer
    from qarl.policy import attach_rollout_view

    cfg = PolicyConfig(quant_cfg="nvfp4_a16", quant_calib_size=16, dtype="bfloat16",
                       generation=GenerationConfig(quant_cfg="fp8_w8a8", allow_quant_mismatch=True))
    texts = task.calibration_texts(16)
    torch.manual_seed(0)
    policy = build_policy(cfg, texts, model_dir=tiny_dir, trainable=True)
    attach_rollout_view(policy, cfg, texts)
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    optimizer.backward(answer_loss(policy, task))
    assert optimizer.step().applied
    name = "model.layers.0.self_attn.q_proj.weight"
    held = dict(policy.model.named_parameters())[name]
    rounded = policy.master[name].to(torch.bfloat16)
    assert not torch.equal(held, rounded)  # the policy's weight holds its NVFP4 value
    view = dict(policy.rollout_model().named_parameters())[name]
    assert torch.equal(view, rounded)
