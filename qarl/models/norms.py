"""RMSNorm layers as fused kernels: `policy.compile_norms`.

An eager RMSNorm runs about seven kernels a pass (the fp32 upcast, square, mean, rsqrt, two products, the cast back)
and as many again in the backward, each reading and writing the whole activation; between the matmuls of a decoder
layer these are much of the update's time. torch.compile fuses each norm's forward and backward into a kernel or
two. Only the norms are compiled: the quantized linear layers (ModelOpt's quantizers, qarl's weight cache) stay eager,
so nothing about quantization changes. Dynamic shapes: one compiled graph for every batch and sequence length.
"""

from __future__ import annotations

from torch import nn


def rms_norms(model: nn.Module) -> list[nn.Module]:
    """The model's RMSNorm layers (transformers names each family's `<Family>RMSNorm`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def compile_norms(model: nn.Module) -> int:
    """Compile each RMSNorm layer of `model` in place; returns how many."""
    norms = rms_norms(model)
    for norm in norms:
        norm.compile(dynamic=True)
    return len(norms)
