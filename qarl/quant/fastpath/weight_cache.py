"""One fake quantization of each weight per change of the weights, shared by every pass that reads it.

ModelOpt's weight quantizer quantizes its weight at every call (every micro-batch, every no-grad pass, the
refit fold). A cached weight quantizer (`WeightCacheMixin`) keeps its last output and quantizes again only after
the weight or the quantizer changed, which it sees by itself, without any caller remembering to tell it:

* an optimizer step anywhere (torch's global post-step hook, `count_optimizer_steps`) changes every trainable
  weight: fused optimizer kernels write parameters without bumping their version counters. A frozen weight
  (LoRA's base) is in no optimizer and changes only by the writes below;
* any other write into the weight bumps its version counter, and a replaced weight is another tensor;
* the quantizer's own changes (amax, switches, config) are tracked by `qarl.quant.mixins.TracksQuantizerChanges`.
Writes through `.data` bypass all of these: call `invalidate(model)` after one (`calibrate` does, after AWQ's
smoothing). ModelOpt's `fold_weight` (not used by qarl) writes that way and then disables the quantizer, which
gives a held weight its master back over the fold: fold a model built from the masters instead.

Numerics: the cached tensor IS ModelOpt's output (the quantizer's own forward, or for the shipped formats the op
that forward ends in, with the same arguments), so a cached forward equals an uncached one bit for bit; gradients
reach the weight through `StraightThrough`, ModelOpt's straight-through estimator (the identity with
`pass_through_bwd`, every shipped format; else zero where |w| > amax).

Mixed precision (fp32 masters, bf16/fp16 compute weights rewritten from them after every step) goes further:
`copy_masters` writes each quantized layer's weight as its quantized value (`WeightCacheMixin.hold`), so the
parameter IS the cache: no second copy, no straight-through node (the gradient w.r.t. a parameter holding Q(w) is
the straight-through gradient wherever it passes through). Anything that changes the quantizer gives the
parameter its unquantized value back; checkpoints and exports read the masters.

`derived` keeps tensors computed from weights (the exact forward's fused q/k/v and gate/up) by the same rules,
freed at every optimizer step. `policy.quant_weight_cache=false` runs without any of this.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from qarl.quant.mixins import TracksQuantizerChanges, mix_in
from qarl.quant.modelopt_compat import (amax_buffer, amax_tensor, clipping_amax, has_pre_quant_scale_buffer,
                                        pass_through_bwd, pre_quant_scale, quantizing)
from qarl.quant.ops import calibrated_spec, fake_quant_eager
from qarl.quant.straight_through import StraightThrough
from qarl.torch_compat import tensor_version

_optimizer_steps = 0  # optimizer steps since `count_optimizer_steps`
_counting_steps = False
# id -> the compute-dtype copies `copy_masters` writes (by id: a WeakSet would compare tensors with ==)
_from_masters: dict[int, weakref.ref] = {}
_derived_owners: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules that keep `derived` tensors
DERIVED = "_qarl_derived"


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for owner in list(_derived_owners):  # stale now: free their memory before the rollouts
        owner.__dict__.pop(DERIVED, None)
    _derived_owners.clear()


def optimizer_steps() -> int:
    """Optimizer steps of the process since `count_optimizer_steps` (0 before it)."""
    return _optimizer_steps


def count_optimizer_steps() -> None:
    """Count every optimizer step of the process from now on (torch's global post-step hook, registered once),
    for `tensor_key`; called by `enable_weight_cache` and `derived`, which key tensors by it."""
    global _counting_steps
    if not _counting_steps:
        register_optimizer_step_post_hook(_count_optimizer_step)
        _counting_steps = True


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What changes when `tensor` is written or replaced, as this module tells changes: the optimizer steps so
    far for a trainable tensor (fused optimizers bump no version), its identity, address, version, dtype and
    shape."""
    steps = _optimizer_steps if tensor.requires_grad else None  # a frozen weight is in no optimizer
    return (steps, id(tensor), tensor.data_ptr(), tensor_version(tensor), tensor.dtype, tuple(tensor.shape))


def derived(owner: nn.Module, name: str, sources: list[torch.Tensor], make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, a tensor computed from `sources` alone (without autograd history), kept on `owner` under `name`
    until one of them changes (`tensor_key`), the next optimizer step, or `invalidate`."""
    if not _counting_steps:
        count_optimizer_steps()
    kept = owner.__dict__.setdefault(DERIVED, {})
    key = tuple(tensor_key(t) for t in sources)
    entry = kept.get(name)
    if entry is None or entry[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor (a later backward may save it)
            entry = kept[name] = (key, make())
        _derived_owners.add(owner)
    return entry[1]


@dataclass(frozen=True)
class _Held:
    """A compute-dtype parameter that holds its own fake-quantized value (`WeightCacheMixin.hold`): the
    master it was written from, and the versions of it and of the amax it was quantized with."""

    weight: nn.Parameter
    master: torch.Tensor
    version: int
    amax: torch.Tensor
    amax_version: int
    generation: int


class WeightCacheMixin(TracksQuantizerChanges):
    """Mixed into a weight quantizer's own class (see `enable_weight_cache`): caches its output, or
    lets the parameter hold it (`hold`)."""

    _qarl_key: tuple | None = None
    _qarl_value: torch.Tensor | None = None
    _qarl_held: _Held | None = None
    _qarl_config: tuple[int, bool] = (-1, False)

    def _qarl_cacheable(self, inputs: torch.Tensor) -> bool:
        """Only plain fake quantization of a parameter is a pure function of (weight, amax): no
        calibration pass, no smoothing scale, rotation or bias, no tracing. A computed weight (LoRA's
        merged W + s B A) is a new tensor at every forward, so it is quantized afresh each time. Read
        at every forward, so what only the config changes is checked once per generation."""
        return (type(inputs) is nn.Parameter and quantizing(self)
                and pre_quant_scale(self) is None and self._qarl_configured() and not torch.compiler.is_compiling())

    def _qarl_configured(self) -> bool:
        generation, plain = self._qarl_config
        if generation != self._qarl_generation:
            plain = self.fake_quant and not self.rotate_is_enabled and self.bias is None
            self._qarl_config = (self._qarl_generation, plain)
        return plain

    def _qarl_cache_key(self, inputs: torch.Tensor) -> tuple:
        amax = amax_tensor(self)
        return (*tensor_key(inputs), self._qarl_generation,
                None if amax is None else (amax.data_ptr(), tensor_version(amax)))

    def holds(self, weight: torch.Tensor) -> bool:
        """`weight` is the parameter this quantizer holds, unchanged since, and the quantizer still computes
        what it computed then. ModelOpt's ways of changing the quantizer end a hold at once
        (`_qarl_changed`); this checks, cheaply enough for every forward, what can change without them:
        writes into the weight or the amax buffer, a new amax buffer, the calibration and quant switches,
        a smoothing scale."""
        held = self._qarl_held
        return (held is not None and weight is held.weight and tensor_version(weight) == held.version
                and held.generation == self._qarl_generation and tensor_version(held.amax) == held.amax_version
                and amax_buffer(self) is held.amax and quantizing(self) and not has_pre_quant_scale_buffer(self))

    def hold(self, weight: nn.Parameter, master: torch.Tensor) -> bool:
        """Quantize `weight` (just written from `master`, the optimizer's wider copy) in place: from now on
        the parameter itself is what the forward, every no-grad pass and the refit fold read, with no cached
        copy and no straight-through node (the gradient of a parameter that holds Q(w) is the gradient
        w.r.t. Q(w), which is the straight-through gradient when it passes through: every shipped format).
        Returns False, changing nothing, where that does not hold (clipping STE, no amax yet, a format other
        than the shipped ones).
        Anything that later changes what this quantizer computes (amax, format, a disable) writes the
        master back unquantized at once, and the quantizer caches again until the next step; another write
        into the parameter (a state load) just ends the hold."""
        if not (self._qarl_cacheable(weight) and pass_through_bwd(self) and calibrated_spec(self) is not None):
            return False
        amax = amax_buffer(self)
        with torch.no_grad():
            weight.copy_(self._qarl_quantize(weight.detach()))
        self._qarl_key, self._qarl_value = None, None
        self._qarl_held = _Held(weight, master, tensor_version(weight), amax, tensor_version(amax),
                                self._qarl_generation)
        return True

    def _qarl_release(self) -> None:
        """End a hold; the parameter gets its unquantized value back unless something else wrote it since."""
        held, self._qarl_held = self._qarl_held, None
        if held is not None and tensor_version(held.weight) == held.version:
            with torch.no_grad():
                held.weight.copy_(held.master)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        held = self._qarl_held
        if held is not None and (inputs is held.weight or _aliases(inputs, held.weight)):
            if self.holds(held.weight):
                return inputs  # already quantized: quantizing it again would round twice
            self._qarl_release()
        if not self._qarl_cacheable(inputs):
            return super().forward(inputs)
        key = self._qarl_cache_key(inputs)
        if key != self._qarl_key:
            self._qarl_value = None  # free the old copy before making the new one
            with torch.no_grad():
                self._qarl_value = self._qarl_quantize(inputs.detach())
            self._qarl_key = key
        if torch.is_grad_enabled() and inputs.requires_grad:
            amax = None if pass_through_bwd(self) else clipping_amax(self, inputs)
            return StraightThrough.apply(inputs, self._qarl_value, amax)
        return self._qarl_value

    def _qarl_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """ModelOpt's output for this weight. For the shipped formats (NVFP4 dynamic blocks, FP8 per
        tensor, static amax) that is the torch op its forward ends in (`plain_spec`), called here directly
        with the same arguments (`fake_quant_eager`), without the forward's per-call Python (the
        re-quantization after every optimizer step pays it once per weight); anything else goes through
        the quantizer's own forward."""
        spec = calibrated_spec(self)
        if spec is None:
            return super().forward(weight)
        return fake_quant_eager(weight, amax_buffer(self).to(weight.device), spec)

    def qarl_invalidate(self) -> None:
        """The weight was written behind its version counter (`.data`): what it holds now is the weight (the
        hold is dropped first, so the change it announces writes nothing back)."""
        self._qarl_held, self._qarl_key, self._qarl_value = None, None, None
        self._qarl_bump()

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) of a quantizer whose weight holds its quantized value would take that
        value for the weight: refused. Copy the model built from the masters instead."""
        if self._qarl_held is not None:
            raise RuntimeError("this model's compute weights hold their fake-quantized values (mixed precision "
                               "after an optimizer step), so a copy of it would quantize them twice; build the "
                               "copy from the master weights (Policy.master_state_dict(), or a saved checkpoint)")
        return {**super().__getstate__(), "_qarl_key": None, "_qarl_value": None}

    def _qarl_changed(self) -> None:
        """ModelOpt changed what this quantizer computes: a held weight is given back at once, since
        readers that skip a disabled quantizer (the refit fold) read the parameter itself."""
        self._qarl_release()


def _aliases(tensor: torch.Tensor, weight: torch.Tensor) -> bool:
    """`tensor` is `weight` under another tensor object (`.detach()`, `.data`): the same memory and shape."""
    return tensor.data_ptr() == weight.data_ptr() and tensor.shape == weight.shape and tensor.dtype == weight.dtype


def single_quantizers(model: nn.Module, role: str = "weight_quantizer") -> Iterator[nn.Module]:
    """Every layer's `role` quantizer that is one TensorQuantizer (not a sequence of them)."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    for module in model.modules():
        quantizer = getattr(module, role, None)
        if isinstance(quantizer, TensorQuantizer) and not isinstance(quantizer, SequentialQuantizer):
            yield quantizer


def enable_weight_cache(model: nn.Module) -> int:
    """Give every (single) weight quantizer of `model` the cache; returns how many. State dict names
    and contents are unchanged: only the class of each quantizer gains the mixin (`Cached<Quantizer>`)."""
    count_optimizer_steps()
    count = 0
    for quantizer in single_quantizers(model):
        mix_in(quantizer, WeightCacheMixin, "Cached", globals())
        quantizer.qarl_invalidate()
        count += 1
    return count


@contextlib.contextmanager
def cache_kept(model: nn.Module) -> Iterator[None]:
    """Keep the cache on quantizers whose class ModelOpt swaps inside the block (its MSE / 4-over-6
    calibration and `modelopt_compat.to_static_block_quantizer` turn a weight quantizer into a
    static-block quantizer, dropping the mixin); their cached values are dropped either way."""
    cached = [q for q in single_quantizers(model) if isinstance(q, WeightCacheMixin)]
    yield
    for quantizer in cached:
        mix_in(quantizer, WeightCacheMixin, "Cached", globals())
        quantizer.qarl_invalidate()


def invalidate(model: nn.Module) -> None:
    """Drop every cached weight and `derived` tensor (needed only after writes that bypass version counters,
    e.g. `.data`)."""
    for quantizer in single_quantizers(model):
        if isinstance(quantizer, WeightCacheMixin):
            quantizer.qarl_invalidate()
    for module in model.modules():
        module.__dict__.pop(DERIVED, None)


def cached_weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """The quantized copies the weight cache keeps beside their parameters now (memory the policy holds)."""
    for q in single_quantizers(model):
        if isinstance(q, WeightCacheMixin) and q._qarl_value is not None:
            yield q._qarl_value


def cache_bytes(model: nn.Module) -> int:
    """Memory the cached quantized weights hold now."""
    return sum(v.numel() * v.element_size() for v in cached_weights(model))


def weight_holders(model: nn.Module) -> dict[int, WeightCacheMixin]:
    """id(parameter) -> the cached weight quantizer of the one layer that uses it, for `copy_masters`. A
    parameter another module also uses (a tied embedding) is left out: it keeps its unquantized value."""
    users = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    return {id(m._parameters["weight"]): m._modules["weight_quantizer"] for m in model.modules()
            if isinstance(m._modules.get("weight_quantizer"), WeightCacheMixin)
            and isinstance(m._parameters.get("weight"), nn.Parameter) and users[id(m._parameters["weight"])] == 1}


def copy_masters(pairs: Iterable[tuple[nn.Parameter, torch.Tensor]], holders: dict[int, WeightCacheMixin]) -> None:
    """Mixed precision, after an optimizer step (and once before the first): each master rounded into its
    compute-dtype parameter, and a quantized layer's weight then quantized in place (`hold`), so each
    weight is quantized once per step, at the step, and every forward reads it as a plain parameter."""
    with torch.no_grad():
        for param, master in pairs:
            if not written_from_master(param):  # (the entry goes when the parameter does)
                _from_masters[id(param)] = weakref.ref(param, lambda _, key=id(param): _from_masters.pop(key, None))
            holder = holders.get(id(param))
            if holder is not None:
                holder._qarl_held = None  # the write below replaces what it held
            param.copy_(master)
            if holder is not None:
                holder.hold(param, master)


def written_from_master(param: nn.Parameter) -> bool:
    """`param` is a compute-dtype copy that `copy_masters` rewrites from its master after every optimizer step:
    its memory holds nothing the master does not (so the rollout engine may own that memory)."""
    written = _from_masters.get(id(param))
    return written is not None and written() is param
