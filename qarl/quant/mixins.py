"""The one way qarl changes what a live module computes: its class gains a mixin (the weight cache on
a weight quantizer, the lean forward on a quantized linear layer, LoRA on an adapted layer), so the
module keeps its identity, attributes and state-dict names, and every hook and reference to it stays."""

from __future__ import annotations

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
