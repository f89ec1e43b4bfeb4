"""The one way qarl changes what a live module computes: its class gains a mixin (the weight cache on
a weight quantizer, the lean forward on a quantized linear layer, LoRA on an adapted layer), so the
module keeps its identity, attributes and state-dict names, and every hook and reference to it stays."""

from __future__ import annotations

import torch

_MADE: dict[tuple[type, type], type] = {}


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
    return _MADE[mixin, cls]


def pre_quant_scale(quantizer) -> torch.Tensor | None:
    """ModelOpt's `quantizer.pre_quant_scale` (AWQ / SmoothQuant's input scale), read from the module's
    buffers: the property's `hasattr` costs an AttributeError through nn.Module's __getattr__ on every
    quantizer without one, at every forward."""
    scale = quantizer._buffers.get("_pre_quant_scale")
    return scale if scale is not None and quantizer._enable_pre_quant_scale else None


class TracksQuantizerChanges:
    """Mixed into a ModelOpt quantizer class by qarl's fast paths (the weight cache, fast inputs): every
    way ModelOpt changes what the quantizer computes goes through one of these methods, each of which
    bumps `_qarl_generation` and calls `_qarl_changed` (what a fast path derived from the old state is
    dropped there). Changes these methods do not see (an in-place write of the amax buffer) bump the
    amax tensor's version, which the fast paths check as well."""

    _qarl_generation: int = 0

    def _qarl_changed(self) -> None:
        pass

    def _qarl_bump(self) -> None:
        self._qarl_generation += 1
        self._qarl_changed()

    def _amax_setter_helper(self, value) -> None:
        super()._amax_setter_helper(value)  # writes through .data: no version bump
        self._qarl_bump()

    def reset_amax(self) -> None:
        super().reset_amax()
        self._qarl_bump()

    def set_from_attribute_config(self, attribute_cfg) -> None:
        super().set_from_attribute_config(attribute_cfg)
        self._qarl_bump()

    def disable(self) -> None:
        super().disable()
        self._qarl_bump()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._qarl_bump()

    def sync_amax_across_distributed_group(self, parallel_group) -> None:
        super().sync_amax_across_distributed_group(parallel_group)  # an in-place all-reduce: no version bump
        self._qarl_bump()

