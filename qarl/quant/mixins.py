"""The one way qarl changes what a live module computes: its class gains a mixin (the weight cache on
a weight quantizer, the lean forward on a quantized linear layer, LoRA on an adapted layer), so the
module keeps its identity, attributes and state-dict names, and every hook and reference to it stays.
Quantizers that qarl's fast paths derive decisions from also track their own changes (`TracksQuantizerChanges`)."""

from __future__ import annotations

import torch

from qarl.quant.modelopt_compat import AnnouncesAmaxWrites
from qarl.torch_compat import AnnouncesStateRewrites

_MADE: dict[tuple[type, type], type] = {}
_BASES: dict[type, type] = {}  # a class `with_mixin` made -> the class it was made from


def with_mixin(mixin: type, cls: type, prefix: str, namespace: dict) -> type:
    """`<prefix><cls name>`: `cls` with `mixin` first among its bases, so the mixin's methods win. Made once
    per (mixin, cls) and bound in `namespace` (the calling module's globals()) so that instances pickle
    and deep-copy like any module. A class that has the mixin already is returned as it is."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _MADE:
        name = f"{prefix}{cls.__name__}"
        made = type(name, (mixin, cls), {"__module__": namespace["__name__"], "__qualname__": name})
        namespace[name] = _MADE[mixin, cls] = made
        _BASES[made] = cls
    return _MADE[mixin, cls]


def without_mixin(cls: type) -> type:
    """The class `with_mixin` made `cls` from (`Lora<Linear>` -> `Linear`): a live module given this class
    back computes as it did before the mixin."""
    return _BASES[cls]


def mix_in(module: torch.nn.Module, mixin: type, prefix: str, namespace: dict) -> None:
    """Give the live `module` the mixin: its class becomes `with_mixin(mixin, type(module), prefix, namespace)`.
    Every class change qarl.quant makes goes through here."""
    module.__class__ = with_mixin(mixin, type(module), prefix, namespace)


class ChangeCount:
    """How many tracked quantizer changes this process has seen (`TracksQuantizerChanges` adds one for each):
    a decision derived from quantizer state (a lean linear layer's `LinearPlan`) stays valid while `value` is
    what it was when the decision was made. One count for the process, not one per model: a change anywhere
    only makes every layer plan again. `value` is a slot, read at every lean linear forward."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


QUANTIZER_CHANGES = ChangeCount()

_UNSET = object()


def _unchanged(old: object, new: object) -> bool:
    """An attribute write that leaves the value as it was (ModelOpt's forward rewrites bookkeeping such as
    the input's dtype or shape at every call, with the same values). A tensor or a mutable container is the
    same only as the same object: an equal new one (an empty hook table) is another object to watch."""
    if old is new:
        return True
    if type(old) is not type(new) or isinstance(new, (torch.Tensor, dict, list, set)):
        return False
    try:
        return bool(old == new)
    except (RuntimeError, TypeError, ValueError):  # containers of tensors compare elementwise
        return False


class TracksQuantizerChanges(AnnouncesStateRewrites, AnnouncesAmaxWrites):
    """Mixed into a ModelOpt quantizer class by qarl's fast paths (the weight cache, fast inputs, the lean
    linear forward's plans): every change of what the quantizer computes bumps `_qarl_generation` and the
    process-wide `QUANTIZER_CHANGES`, and calls `_qarl_changed` (what a fast path derived from the old state
    is dropped there). Changes are seen where they are made: any attribute written with a new value (the
    enable, quantize and calibrate switches, which ModelOpt also writes directly, a config attribute, a buffer
    assigned, a class swapped), a buffer registered, deleted or replaced (`module.to`: `AnnouncesStateRewrites`),
    and ModelOpt's writes that bypass attributes (the amax setter, `AnnouncesAmaxWrites`, and the
    tensor-parallel max-reduce write through `.data` or in place; a state load). In-place writes of the amax
    buffer bump its version, which the fast paths check as well. Not seen: writes past the attributes (into
    `__dict__`, `_buffers` or a config container in place, `tensor.data = ...`), which nothing in qarl or in
    ModelOpt's paths that qarl runs makes. qarl's own `_qarl_*` bookkeeping is no change, nor is `training`
    (`model.train()` / `eval()` write it on every module; no quantizer reads it)."""

    _qarl_generation: int = 0

    def _qarl_changed(self) -> None:
        pass

    def _qarl_bump(self) -> None:
        self._qarl_generation += 1
        QUANTIZER_CHANGES.value += 1
        self._qarl_changed()

    def __setattr__(self, name: str, value) -> None:
        if name == "__class__":  # ModelOpt turns a quantizer into another kind (static blocks) by a class swap:
            self._qarl_bump()  # announced while this class's methods still answer
            super().__setattr__(name, value)
            return
        buffers = self.__dict__.get("_buffers", {})
        old = buffers[name] if name in buffers else self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        if not name.startswith("_qarl_") and name != "training" and not _unchanged(old, value):
            self._qarl_bump()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if not name.startswith("_qarl_"):
            self._qarl_bump()

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        self._qarl_bump()

    def sync_amax_across_distributed_group(self, parallel_group) -> None:
        super().sync_amax_across_distributed_group(parallel_group)  # an in-place all-reduce: no version bump
        self._qarl_bump()


def track_changes(quantizer: torch.nn.Module) -> None:
    """Give `quantizer` (one that no fast path changes otherwise: an output quantizer) the tracking alone."""
    mix_in(quantizer, TracksQuantizerChanges, "Tracked", globals())
