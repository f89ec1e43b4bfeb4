"""ModelOpt's straight-through estimator as one autograd function, for a quantized value computed outside autograd:
a cached weight (`qarl.quant.fastpath.weight_cache`), a layer input's op (`qarl.quant.fastpath.lean_forward`,
`qarl.quant.input_variants`)."""

from __future__ import annotations

import torch


class StraightThrough(torch.autograd.Function):
    """Forward: `quantized`, computed without autograd (a cached weight, a layer input's op). Backward:
    ModelOpt's straight-through estimator to the unquantized tensor."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, quantized: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        if amax is not None:
            ctx.save_for_backward(weight, amax)
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not ctx.saved_tensors:
            return grad, None, None
        weight, amax = ctx.saved_tensors
        return torch.where(weight.abs() <= amax, grad, grad.new_zeros(1)), None, None
