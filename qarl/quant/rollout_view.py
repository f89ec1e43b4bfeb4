"""Rollouts quantized differently from the policy: the engine's own post-training quantization of the
policy, refreshed at every refit (`policy.generation.allow_quant_mismatch`).

FP8 rollouts of a bf16 policy (TRL's FP8-rollout recipe, FlashRL) sample from a quantized engine while the
policy trains in full precision, and correct the mismatch with importance sampling. The engine takes
folded weights and input amax from a model quantized in *its* format, so qarl keeps one: a second copy
of the policy's architecture, quantized with the generation format. Before each refit it takes the
policy's current weights (unquantized: the policy's own quantizers, if any, are not applied) and is
recalibrated from scratch on the same calibration data, as a fresh PTQ of that policy would be. The
engine then loads it like any quantized policy. What this costs against synced QA-GRPO shows in
`mismatch/kl`; the loops correct it with truncated importance sampling.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from qarl.quant.formats import QuantFormat
from qarl.quant.quantize import calibrate


class RolloutView:
    """`sync(policy_model)` -> the rollout model: the policy's weights, quantized and calibrated in `fmt`."""

    def __init__(self, model: nn.Module, fmt: QuantFormat, batches: list[dict[str, torch.Tensor]]):
        self.model, self.fmt, self.batches = model, fmt, batches

    @torch.no_grad()
    def sync(self, weights: Mapping[str, torch.Tensor]) -> nn.Module:
        """`weights`: the policy's unquantized weights by parameter name (its masters, rounded here: a
        mixed-precision policy's compute weights hold their own quantized values)."""
        for name, target in self.model.named_parameters():
            target.copy_(weights[name])
        calibrate(self.model, self.fmt, self.batches)
        return self.model
