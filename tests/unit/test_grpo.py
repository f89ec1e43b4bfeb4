"""GRPO math against direct computations, and the trainer's input checks."""

from __future__ import annotations

import math

import pytest
import torch

from qarl.config import ConfigError, TrainerConfig, check_grpo_recipe, check_qad_recipe, load_recipe
from qarl.grpo import (group_advantages, grpo_loss, overlong_punishment, sequence_weights, soft_overlong_penalty,
                       zero_std_share)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, frac_zero = group_advantages(rewards, 4, "group")
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()
    assert adv[0].item() == pytest.approx(0.75 / (std + 1e-4))
    assert adv[4:].abs().max().item() == 0.0
    assert frac_zero == 0.5
    adv_none, _ = group_advantages(rewards, 4, "none")
    assert adv_none[:4].tolist() == [0.75, -0.25, -0.25, -0.25]
    adv_batch, _ = group_advantages(rewards, 4, "batch")
    assert adv_batch[0].item() == pytest.approx(0.75 / (rewards.std().item() + 1e-4))


def _direct_loss(lp, old, eng, ref, adv, mask, cfg):
    """Loop-by-loop reference of the GRPO objective for one batch."""
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    per_seq, all_tokens = [], []
    batch, width = len(lp), len(lp[0])
    for i in range(batch):
        n = int(mask[i].sum())
        seq_ratio = math.exp(sum(lp[i][t] - old[i][t] for t in range(n)) / n)
        terms = []
        for t in range(n):
            r = seq_ratio if cfg.importance_sampling_level == "sequence" else math.exp(lp[i][t] - old[i][t])
            clipped = min(max(r, 1 - cfg.epsilon), 1 + eps_high)
            term = -min(r * adv[i], clipped * adv[i])
            if cfg.vllm_importance_sampling_correction:
                term *= min(math.exp(old[i][t] - eng[i][t]), cfg.vllm_importance_sampling_cap)
            if cfg.beta:
                d = ref[i][t] - lp[i][t]
                term += cfg.beta * (math.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(terms)
        all_tokens += terms
    if cfg.loss_type == "grpo":
        return sum(sum(s) / len(s) for s in per_seq) / batch
    if cfg.loss_type == "dr_grpo":
        return sum(all_tokens) / (batch * width)
    return sum(all_tokens) / len(all_tokens)  # dapo, and bnpo with a single micro-batch


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, tis", [(0.0, False), (0.04, True)])
def test_loss_matches_direct_computation(loss_type, level, beta, tis):
    torch.manual_seed(0)
    cfg = TrainerConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=0.28,
                        vllm_importance_sampling_correction=tis, vllm_importance_sampling_cap=1.5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    old = -torch.rand(3, 4, dtype=torch.float64)
    lp = (old + 0.3 * torch.randn(3, 4, dtype=torch.float64)) * mask
    eng = old + 0.2 * torch.randn(3, 4, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(3, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    weights = sequence_weights(mask, loss_type, 3, 4, int(mask.sum()), 1, int(mask.sum()))
    terms = grpo_loss(lp, old * mask, eng, ref, adv, mask, weights, cfg)
    expected = _direct_loss(lp.tolist(), (old * mask).tolist(), eng.tolist(), ref.tolist(), adv.tolist(), mask, cfg)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_micro_batches_sum_to_the_full_batch_loss():
    torch.manual_seed(1)
    cfg = TrainerConfig(loss_type="grpo")
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    old = -torch.rand(6, 5)
    lp = old + 0.1 * torch.randn(6, 5)
    adv = torch.randn(6)
    for loss_type in ["grpo", "dr_grpo", "dapo"]:
        cfg.loss_type = loss_type
        total = int(mask.sum())
        weights = sequence_weights(mask, loss_type, 6, 5, total, 1, total)
        full = grpo_loss(lp, old, old, None, adv, mask, weights, cfg).loss
        parts = sum(grpo_loss(lp[s], old[s], old[s], None, adv[s], mask[s],
                              sequence_weights(mask[s], loss_type, 6, 5, total, 2, int(mask[s].sum())), cfg).loss
                    for s in (slice(0, 3), slice(3, 6)))
        assert parts.item() == pytest.approx(full.item(), rel=1e-5)


def test_gradient_of_loss_is_policy_gradient_at_ratio_one():
    """At the rollout point (ratio 1, no clipping) d loss / d logp = -A * weight."""
    cfg = TrainerConfig(loss_type="dapo", vllm_importance_sampling_correction=False)
    mask = torch.ones(2, 3)
    old = -torch.rand(2, 3)
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    grpo_loss(lp, old, old, None, adv, mask, sequence_weights(mask, "dapo", 2, 3, 6, 1, 6), cfg).loss.backward()
    assert torch.allclose(lp.grad, -adv[:, None].expand(2, 3) / 6)


@pytest.mark.parametrize("changes, needle", [(["trainer.num_generations=1"], "at least 2"),
                                             (["trainer.batch_size=30", "trainer.num_generations=8"], "not divisible"),
                                             (["trainer.loss_type=ppo"], "loss_type"),
                                             (["trainer.scale_rewards=std"], "scale_rewards"),
                                             (["trainer.importance_sampling_level=seq"], "importance_sampling_level"),
                                             (["trainer.soft_overlong_tokens=64", "policy.generation.max_new_tokens=64"],
                                              "soft_overlong_tokens=64 must be below "
                                              "policy.generation.max_new_tokens=64"),
                                             (["trainer.soft_overlong_start_step=5"],
                                              "which is off .*set trainer.soft_overlong_tokens"),
                                             (["trainer.soft_overlong_tokens=4", "trainer.steps=3",
                                               "trainer.soft_overlong_start_step=3"],
                                              "soft_overlong_start_step=3 is not below trainer.steps=3")])
def test_bad_trainer_settings_are_named(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        check_grpo_recipe(load_recipe("recipes/qa_grpo_tiny.yaml", changes))


@pytest.mark.parametrize("key", ["soft_overlong_tokens", "soft_overlong_start_step"])
def test_qad_refuses_the_overlong_punishment_it_would_not_use(key):
    with pytest.raises(ConfigError, match=f"QAD learns from its teacher's KL.*{key}=0"):
        check_qad_recipe(load_recipe("recipes/qa_distillation_tiny.yaml", [f"trainer.{key}=8"]))


def test_soft_overlong_penalty_values():
    """DAPO's punishment with a 256-token limit and a 64-token buffer: 0 up to 192 tokens, then -1/64 a token, -1 at
    256; a truncated completion -1 at any length (max_model_len cut it first)."""
    lengths = torch.tensor([0, 100, 192, 193, 224, 255, 256, 100])
    truncated = torch.tensor([False] * 6 + [True, True])
    penalty = soft_overlong_penalty(lengths, truncated, max_tokens=256, cache_tokens=64)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -1 / 64, -0.5, -63 / 64, -1.0, -1.0])
    assert soft_overlong_penalty(torch.tensor([256]), torch.tensor([False]), 256, 64).item() == -1.0  # EOS at the limit


def test_the_punishment_starts_at_its_start_step():
    """trainer.soft_overlong_start_step=10: no punishment at steps 0, 5 and 9 (a truncated completion scores like any
    other wrong one), the whole of it, scaled by soft_overlong_penalty, from step 10 on."""
    t = TrainerConfig(soft_overlong_tokens=64, soft_overlong_penalty=0.5, soft_overlong_start_step=10)
    lengths, truncated = torch.tensor([40, 224, 256]), torch.tensor([False, False, True])
    for step in (0, 5, 9):
        assert overlong_punishment(lengths, truncated, 256, step, t).tolist() == [0.0, 0.0, 0.0]
    for step in (10, 11, 59):
        assert overlong_punishment(lengths, truncated, 256, step, t).tolist() == pytest.approx([0.0, -0.25, -0.5])
    t.soft_overlong_start_step = 0  # the default: from the first step, as before the knob
    assert overlong_punishment(lengths, truncated, 256, 0, t).tolist() == pytest.approx([0.0, -0.25, -0.5])


def test_a_smaller_punishment_weight_does_not_quiet_a_group_without_task_signal():
    """Why the start is a delay, not a ramp of the weight: a group all wrong whose rewards differ only by the
    punishment gets the same group-scaled advantages at a tenth of the weight as at the whole; only 0 silences it."""
    lengths, truncated = torch.tensor([40, 224, 40, 256]), torch.tensor([False, False, False, True])
    penalty = soft_overlong_penalty(lengths, truncated, 256, 64)
    whole, _ = group_advantages(penalty, 4, "group")
    tenth, _ = group_advantages(0.1 * penalty, 4, "group")
    assert tenth.tolist() == pytest.approx(whole.tolist(), rel=0.01)  # the std's +1e-4 differs a little
    assert group_advantages(0.0 * penalty, 4, "group")[0].abs().max().item() == 0.0


def test_the_punishment_orders_a_group_before_truncated_completions_are_masked():
    """A group of four (right and short, right inside the buffer, wrong and short, truncated): the punishment ranks
    their advantages in that order. mask_truncated_completions then drops only the truncated one's loss; its -1 still
    lowers the group's baseline, so the short answers' advantages rise and the late one's falls: the two compose."""
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    penalty = soft_overlong_penalty(torch.tensor([40, 224, 40, 256]), torch.tensor([False, False, False, True]), 256, 64)
    advantages, _ = group_advantages(correct + penalty, 4, "none")
    assert advantages.tolist() == pytest.approx([0.875, 0.375, -0.125, -1.125])
    plain, _ = group_advantages(correct, 4, "none")
    assert plain.tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5])


def test_the_punishment_hides_a_group_without_task_signal():
    """A group all wrong, whose answers differ only in length, has a spread once punished: the share of groups
    without a signal reads 0 after the punishment and 0.5 on the task reward alone (reward/frac_zero_std_task)."""
    correct = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    penalty = soft_overlong_penalty(torch.tensor([40, 224, 40, 256, 40, 40, 40, 40]),
                                    torch.tensor([False, False, False, True, False, False, False, False]), 256, 64)
    assert zero_std_share(correct, 4) == 0.5
    assert zero_std_share(correct + penalty, 4) == 0.0 == group_advantages(correct + penalty, 4, "group")[1]
