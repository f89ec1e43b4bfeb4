"""A qlora policy's adapters inside the rollout engine by forward hooks, where vLLM's own LoRA cannot serve them
(`qarl.generation.vllm_lora.hooks_needed`) and the engine does not merge them (`merges_adapters`: an activation format,
a packed base, or `policy.generation.qlora_adapters=lora`).

The engine's (fused) linear layers get a forward hook that adds s B A x to the slice of the output that
belongs to each adapted part (q, k, v inside qkv_proj; gate, up inside gate_up_proj), computed by
`qarl.lora.adapter_output` from the layer's input before its input is fake-quantized, exactly as the
policy's adapted layer does. A refit copies A and B into buffers the hooks own (in place after the first
time), so each step moves only the adapter, while the base weights the engine holds stay as folded once.

Hooks run only eagerly (a compiled graph would not see them), computing `adapter_output` as the policy does. They
need unsharded layers (tensor_parallel_size=1; checked in `qarl.lora.check_lora`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from qarl.generation import vllm_compat
from qarl.lora import adapter_output


@dataclass
class _Slot:
    """One adapted part of an engine layer: its output columns [start, start + width) and its adapter."""

    start: int
    width: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float


def engine_part(packed: dict[str, list[str]], policy_name: str) -> tuple[str, list[str]]:
    """(the engine layer a policy layer is part of, the policy layers stacked before it there): q, k, v inside
    qkv_proj and gate, up inside gate_up_proj, in vLLM's order (`packed`: `vllm_compat.packed_modules`)."""
    parent, _, leaf = policy_name.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}", [f"{parent}.{p}" for p in parts[: parts.index(leaf)]]
    return policy_name, []


class EngineAdapters:
    """`load(adapters, policy_modules)` -> bytes copied; the hooks add the adapters to the engine's forward. The
    rest of the interface `VLLMAdapters` (qarl/generation/vllm_lora.py) has, for the engine: nothing to do."""

    request = None  # generate calls name no vLLM adapter

    def unwrapped(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def ensure_active(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __init__(self, engine_model: nn.Module):
        self.model = engine_model
        self.modules = dict(engine_model.named_modules())
        self.packed: dict[str, list[str]] = vllm_compat.packed_modules(engine_model)
        self.slots: dict[str, dict[str, _Slot]] = {}  # engine layer -> policy layer -> slot
        self.hooked: set[str] = set()

    def _place(self, policy_name: str, policy_modules: dict[str, nn.Module]) -> tuple[str, int, int]:
        """(engine layer, first output column, width) of a policy layer: fused parts sit side by side."""
        engine_name, before = engine_part(self.packed, policy_name)
        start = sum(policy_modules[name].out_features for name in before)
        return engine_name, start, policy_modules[policy_name].out_features

    def _hook(self, engine_name: str):
        def add_adapters(module: nn.Module, inputs: tuple, output):
            slots = self.slots.get(engine_name)
            if not slots:
                return None
            out = output[0] if isinstance(output, tuple) else output  # vLLM linears return (output, bias)
            x = inputs[0]
            for slot in slots.values():
                out[..., slot.start: slot.start + slot.width] += adapter_output(x, slot.lora_a, slot.lora_b, slot.scale)
            return output

        return add_adapters

    @torch.no_grad()
    def load(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
             policy_modules: dict[str, nn.Module]) -> int:
        """Make the engine's adapters equal `adapters` ({policy layer: (A, B, s)}); returns bytes copied.
        An empty dict removes them (a refit from a policy without qlora adapters)."""
        copied = 0
        seen: set[tuple[str, str]] = set()
        for name, (lora_a, lora_b, scale) in adapters.items():
            engine_name, start, width = self._place(name, policy_modules)
            if engine_name not in self.modules:
                raise RuntimeError(f"the engine has no layer {engine_name} for the policy's adapted layer {name}")
            slots = self.slots.setdefault(engine_name, {})
            slot = slots.get(name)
            if slot is None or slot.lora_a.shape != lora_a.shape or slot.lora_b.shape != lora_b.shape:
                device = next(self.modules[engine_name].parameters()).device
                slots[name] = _Slot(start, width, lora_a.detach().to(device, copy=True),
                                    lora_b.detach().to(device, copy=True), scale)
            else:
                slot.lora_a.copy_(lora_a)
                slot.lora_b.copy_(lora_b)
                slot.scale = scale
            copied += lora_a.numel() * lora_a.element_size() + lora_b.numel() * lora_b.element_size()
            seen.add((engine_name, name))
            if engine_name not in self.hooked:
                self.modules[engine_name].register_forward_hook(self._hook(engine_name))
                self.hooked.add(engine_name)
        for engine_name, slots in self.slots.items():
            for name in [n for n in slots if (engine_name, n) not in seen]:
                del slots[name]
        return copied
