"""GRPO's math, free of models and engines: the overlong punishment, advantages, the clipped surrogate, KL, loss
aggregation.

Conventions follow TRL's GRPOTrainer so that its users find the knobs they know. Tensors are padded
[batch, tokens] with a 0/1 `mask` over completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qarl.config import TrainerConfig



def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, float]:
    """(reward - group mean) / std, std taken per group, over the batch, or not at all.

    Returns the advantages and the fraction of groups whose rewards are all equal (no signal).
    """
    grouped = rewards.view(-1, num_generations)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    group_std = grouped.std(dim=1)
    if scale == "group":
        centered = centered / (group_std.repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        centered = centered / (rewards.std() + 1e-4)
    return centered, zero_std_share(rewards, num_generations)


def zero_std_share(rewards: torch.Tensor, num_generations: int) -> float:
    """The fraction of groups whose rewards are all equal: groups that give the update nothing to follow."""
    group_std = rewards.view(-1, num_generations).std(dim=1)
    return torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()


def soft_overlong_penalty(lengths: torch.Tensor, truncated: torch.Tensor, max_tokens: int, cache_tokens: int
                          ) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, "overlong reward shaping") of each
    completion, in [-1, 0]: 0 up to max_tokens - cache_tokens tokens, then (max_tokens - cache_tokens - length) /
    cache_tokens, -1 at max_tokens. A truncated completion gets -1 whatever its length (the engine's max_model_len
    may cut it before max_tokens): it would have run past the limit."""
    penalty = ((max_tokens - cache_tokens - lengths.float()) / cache_tokens).clamp(-1.0, 0.0)
    return torch.where(truncated, torch.full_like(penalty, -1.0), penalty)


def overlong_punishment(lengths: torch.Tensor, truncated: torch.Tensor, max_tokens: int, step: int,
                        t: TrainerConfig) -> torch.Tensor:
    """What the loop adds to each completion's reward at `step`: DAPO's punishment scaled by
    trainer.soft_overlong_penalty, from trainer.soft_overlong_start_step on, and 0 before it, so that a start with many
    truncated answers and almost no task reward learns from the task first. A delay, not a ramp of the weight: a group
    whose rewards differ only by the punishment gets the same advantages at any weight above 0 once scaled by its std
    (scale_rewards=group), so only a weight of 0 keeps the punishment from being such a group's whole signal."""
    if step < t.soft_overlong_start_step:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    return t.soft_overlong_penalty * soft_overlong_penalty(lengths, truncated, max_tokens, t.soft_overlong_tokens)


def sequence_weights(mask: torch.Tensor, loss_type: str, batch_size: int, max_completion_length: int,
                     total_tokens: int, num_micro_batches: int, micro_batch_tokens: int) -> torch.Tensor:
    """Per-sequence factor w_i so that loss = sum_i w_i * sum_t mask_it * loss_it, summed over micro-batches,
    reproduces each loss type's normalization over the whole step batch. The token counts come from the host (the
    mask's own sum would make the host wait for the GPU)."""
    lengths = mask.sum(dim=1)
    if loss_type == "grpo":  # mean over each sequence's tokens, then over sequences
        return 1.0 / (batch_size * lengths.clamp(min=1))
    if loss_type == "dr_grpo":  # constant normalizer: no length bias
        return torch.full_like(lengths, 1.0 / (batch_size * max_completion_length))
    if loss_type == "dapo":  # token mean over the whole batch
        return torch.full_like(lengths, 1.0 / max(total_tokens, 1))
    # bnpo: token mean within each micro-batch, averaged over micro-batches
    return torch.full_like(lengths, 1.0 / (max(micro_batch_tokens, 1) * num_micro_batches))


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, already normalized (sum of micro-batch losses = the step's loss)
    clip_fraction: torch.Tensor  # over completion tokens
    kl: torch.Tensor | None  # per-token k3 KL to the reference (masked mean), if beta > 0
    is_weight_mean: torch.Tensor | None


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_weights: torch.Tensor,
    cfg: TrainerConfig,
) -> LossTerms:
    """The clipped surrogate with optional KL penalty and truncated importance sampling, on one micro-batch."""
    log_ratio = logprobs - old_logprobs
    if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, the mean token log-ratio
        log_ratio = ((log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)
    is_mean = None
    if cfg.vllm_importance_sampling_correction:
        # Truncated importance sampling: the engine sampled, the policy scores; reweight by their ratio.
        is_weight = torch.exp(old_logprobs - engine_logprobs).clamp(max=cfg.vllm_importance_sampling_cap).detach()
        per_token = per_token * is_weight
        is_mean = (is_weight * mask).sum() / mask.sum().clamp(min=1)
    kl = None
    if ref_logprobs is not None and cfg.beta > 0:
        delta = ref_logprobs - logprobs
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + cfg.beta * per_token_kl
        kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1)
    loss = (per_token * mask * seq_weights.unsqueeze(1)).sum()
    was_clipped = (unclipped != clipped).float().expand_as(mask)
    clip_fraction = (was_clipped * mask).sum() / mask.sum().clamp(min=1)
    return LossTerms(loss=loss, clip_fraction=clip_fraction.detach(), kl=None if kl is None else kl.detach(),
                     is_weight_mean=is_mean)
