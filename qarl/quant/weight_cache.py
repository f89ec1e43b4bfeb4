"""One fake quantization of each weight per change of the weights, shared by every pass that reads it.

ModelOpt's weight quantizer quantizes its weight at every call: every training forward of every
micro-batch, every no-grad pass (old / reference log-probs, evaluation) and the refit fold. A weight
changes only when something writes it (an optimizer step, a checkpoint load, the master -> compute
copy of mixed precision), and its amax only when calibration or a state load sets it. A cached weight
quantizer keeps its last output and quantizes again only after one of them changed, which it sees by
itself, without any caller remembering to tell it:

* every optimizer step anywhere (torch's global step hook) counts as a change of a trainable weight:
  fused optimizer kernels write parameters without bumping their version counters (seen with
  AdamW(fused=True)); a frozen weight (requires_grad=False: LoRA's base) is in no optimizer, so only
  the writes below change it, and it is quantized once for the whole run;
* any other write into the weight bumps the tensor's version counter (in-place ops: `copy_`,
  `load_state_dict`, `mul_`), and a replaced weight (`module.to(...)`) is another storage;
* amax changes go through ModelOpt's setter, which writes through `.data` (invisible to version
  counters) and is overridden here to bump a generation, as are the max-reduce across tensor-parallel
  ranks (an in-place all-reduce, also invisible) and state-dict loads; any other in-place write of the
  amax buffer bumps its version.
Writes through `.data` (`p.data.copy_(x)`) bypass version counters: call `invalidate(model)` after
such a write. In qarl only AWQ's smoothing (ModelOpt, inside `calibrate`) writes weights that way, and
`calibrate` invalidates after it.

Numerics: the cached tensor IS ModelOpt's output (the quantizer's own forward computes it, or for
the shipped formats the op that forward ends in, with the same arguments), so a cached forward equals an
uncached one bit for bit. Gradients reach the weight through
`_StraightThrough`, whose backward is ModelOpt's straight-through estimator: the identity with
`pass_through_bwd` (every shipped format), else the gradient zeroed where |w| > amax.

Memory: one quantized copy of each quantized weight in the weight's dtype (`cache_bytes`);
`policy.quant_weight_cache=false` turns it off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from qarl.quant.mixins import with_mixin


_optimizer_steps = 0


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class _StraightThrough(torch.autograd.Function):
    """Forward: the cached quantized weight. Backward: ModelOpt's STE for the weight."""

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


class WeightCacheMixin:
    """Mixed into a weight quantizer's own class (see `enable_weight_cache`): caches its output."""

    _qarl_key: tuple | None = None
    _qarl_value: torch.Tensor | None = None
    _qarl_generation: int = 0

    def _qarl_cacheable(self, inputs: torch.Tensor) -> bool:
        """Only plain fake quantization of a parameter is a pure function of (weight, amax): no
        calibration pass, no smoothing scale, rotation or bias, no tracing. A computed weight (LoRA's
        merged W + s B A) is a new tensor at every forward, so it is quantized afresh each time."""
        return (type(inputs) is nn.Parameter and self.is_enabled and self._if_quant
                and not self._if_calib and self._fake_quant and self.pre_quant_scale is None
                and not self.rotate_is_enabled and getattr(self, "_bias", None) is None
                and not torch.compiler.is_compiling())

    def _qarl_cache_key(self, inputs: torch.Tensor) -> tuple:
        amax = getattr(self, "_amax", None)
        steps = _optimizer_steps if inputs.requires_grad else None  # a frozen weight is in no optimizer
        return (steps, id(inputs), inputs.data_ptr(), inputs._version, inputs.dtype, tuple(inputs.shape),
                self._qarl_generation, None if amax is None else (amax.data_ptr(), amax._version))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self._qarl_cacheable(inputs):
            return super().forward(inputs)
        key = self._qarl_cache_key(inputs)
        if key != self._qarl_key:
            self._qarl_value = None  # free the old copy before making the new one
            with torch.no_grad():
                self._qarl_value = self._qarl_quantize(inputs.detach())
            self._qarl_key = key
        if torch.is_grad_enabled() and inputs.requires_grad:
            amax = None if self._pass_through_bwd else self._get_amax(inputs)
            return _StraightThrough.apply(inputs, self._qarl_value, amax)
        return self._qarl_value

    def _qarl_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """ModelOpt's output for this weight. For the shipped formats (NVFP4 dynamic blocks, FP8 per
        tensor, static amax) that is the torch op its forward ends in, called here directly with the same
        arguments, which skips ~150 us of per-call Python (the refit fold after every optimizer step pays
        it once per weight); anything else goes through the quantizer's own forward."""
        from modelopt.torch.quantization import tensor_quant

        amax = getattr(self, "_amax", None)
        blocks = self.block_sizes or {}
        static = (amax is not None and not self._dynamic and not self._use_constant_amax and not self.is_mx_format
                  and self.bias_calibrator is None)
        if static and blocks.get("type") == "dynamic" and self._num_bits == (2, 1) and blocks.get("scale_bits") == (4, 3) \
                and [k for k in blocks if isinstance(k, int)] == [-1]:
            return tensor_quant.dynamic_block_quantize_op(weight.contiguous(), blocks[-1], amax.to(weight.device), 4, 2, 8, 4)
        if static and not blocks and self._num_bits == (4, 3) and self._axis is None and amax.numel() == 1:
            return tensor_quant.quantize_op(weight.contiguous(), amax.to(weight.device), num_bits=8, exponent_bits=4,
                                            unsigned=False, narrow_range=False)
        return super().forward(weight)

    def qarl_invalidate(self) -> None:
        self._qarl_key, self._qarl_value = None, None

    # Every way ModelOpt changes what this quantizer computes goes through one of these.
    def _amax_setter_helper(self, value: torch.Tensor) -> None:
        super()._amax_setter_helper(value)
        self._qarl_generation += 1

    def reset_amax(self) -> None:
        super().reset_amax()
        self._qarl_generation += 1

    def set_from_attribute_config(self, attribute_cfg) -> None:
        super().set_from_attribute_config(attribute_cfg)
        self._qarl_generation += 1

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._qarl_generation += 1

    def sync_amax_across_distributed_group(self, parallel_group) -> None:
        super().sync_amax_across_distributed_group(parallel_group)  # an in-place all-reduce: no version bump
        self._qarl_generation += 1


def _cached_class(cls: type) -> type:
    """`Cached<Quantizer>`: the quantizer's class with the cache mixed in."""
    return with_mixin(WeightCacheMixin, cls, "Cached", globals())


def _weight_quantizers(model: nn.Module):
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if isinstance(quantizer, TensorQuantizer) and not isinstance(quantizer, SequentialQuantizer):
            yield quantizer


def enable_weight_cache(model: nn.Module) -> int:
    """Give every (single) weight quantizer of `model` the cache; returns how many. State dict names
    and contents are unchanged: only the class of each quantizer gains the mixin."""
    count = 0
    for quantizer in _weight_quantizers(model):
        quantizer.__class__ = _cached_class(type(quantizer))
        quantizer.qarl_invalidate()
        count += 1
    return count


@contextlib.contextmanager
def cache_kept(model: nn.Module) -> Iterator[None]:
    """Keep the cache on quantizers whose class ModelOpt swaps inside the block (its MSE / 4-over-6
    calibration and `StaticBlockScaleQuantizer.from_tensor_quantizer` turn a weight quantizer into a
    static-block quantizer, dropping the mixin); their cached values are dropped either way."""
    cached = [q for q in _weight_quantizers(model) if isinstance(q, WeightCacheMixin)]
    yield
    for quantizer in cached:
        quantizer.__class__ = _cached_class(type(quantizer))
        quantizer.qarl_invalidate()


def invalidate(model: nn.Module) -> None:
    """Drop every cached weight (needed only after writes that bypass version counters, e.g. `.data`)."""
    for quantizer in _weight_quantizers(model):
        if isinstance(quantizer, WeightCacheMixin):
            quantizer.qarl_invalidate()


def cache_bytes(model: nn.Module) -> int:
    """Memory the cached quantized weights hold now."""
    return sum(q._qarl_value.numel() * q._qarl_value.element_size() for q in _weight_quantizers(model)
               if isinstance(q, WeightCacheMixin) and q._qarl_value is not None)
