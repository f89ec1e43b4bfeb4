"""A quantized linear layer's forward without ModelOpt's per-call module machinery.

ModelOpt's QuantLinear forward reaches `F.linear` through a context manager, a dynamic `weight`
attribute, an MRO scan for monkey-patched forwards and calls of disabled quantizers: about 60 us of
Python per layer and call, measured on CPU, which on a GPU exceeds the matmul it wraps (a no-grad pass
of a Qwen2.5-0.5B-shaped model took 2x the unquantized one with W4A16, whose weights were already
cached). `lean_forward` makes the same calls in the same order, and nothing else:

    y = output_quantizer(F.linear(input_quantizer(x), weight_quantizer(W), b))

skipping only quantizers that are disabled (for which ModelOpt returns the tensor unchanged), so the
result and the gradients are ModelOpt's bit for bit (tests/test_weight_cache.py checks both).
Installed by giving each plain linear layer a subclass of its own class (so deep copies and state
dicts are unchanged); a layer with a patched forward (accelerate hooks, `_forward_pre_dm`) or a
non-`TensorQuantizer` quantizer keeps ModelOpt's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qarl.quant.mixins import with_mixin


def quantized_linear(layer: nn.Module, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's quantized linear math with `weight` in place of the layer's own parameter (LoRA's
    merged mode serves W + s B A through it). A layer without quantizers is a plain `F.linear`."""
    input_quantizer = getattr(layer, "input_quantizer", None)
    if input_quantizer is not None and (input_quantizer.is_enabled or input_quantizer.pre_quant_scale is not None):
        input = input_quantizer(input)  # a disabled one still applies AWQ's smoothing scale, as in ModelOpt
    weight_quantizer = getattr(layer, "weight_quantizer", None)
    if weight_quantizer is not None and weight_quantizer.is_enabled:
        weight = weight_quantizer(weight)
    output = F.linear(input, weight, layer._parameters.get("bias"))
    output_quantizer = getattr(layer, "output_quantizer", None)
    if output_quantizer is not None and output_quantizer.is_enabled:
        output = output_quantizer(output)
    return output


def lean_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return quantized_linear(self, input, self._parameters["weight"])


def enable_lean_forward(model: nn.Module) -> int:
    """Give every plain quantized linear layer of `model` the lean forward; returns how many."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer
    from modelopt.torch.quantization.nn.modules.quant_linear import _QuantLinear

    count = 0
    for module in model.modules():
        quantizers = [getattr(module, q, None) for q in ("input_quantizer", "weight_quantizer", "output_quantizer")]
        plain = (isinstance(module, _QuantLinear) and isinstance(module, nn.Linear)
                 and type(module).forward in (_QuantLinear.forward, lean_forward)
                 and not hasattr(module, "_forward_pre_dm")
                 and all(isinstance(q, TensorQuantizer) and not isinstance(q, SequentialQuantizer) for q in quantizers))
        if plain:
            module.__class__ = _lean_class(type(module))
            count += 1
    return count


class LeanForward:
    """Mixed into a quantized linear layer's class (see `enable_lean_forward`)."""

    forward = lean_forward


def _lean_class(cls: type) -> type:
    return with_mixin(LeanForward, cls, "Lean", globals())
