"""A qlora policy's adapters served by vLLM's own LoRA layers and kernels: rollouts with CUDA graphs.

The engine starts with vLLM's LoRA on (`engine_options`: one adapter slot, the policy's rank rounded up to a rank
vLLM takes). The first refit writes the policy's adapter as a PEFT directory and has vLLM load it once, pinned
in its slot; every refit (that one included) then copies A and s B into vLLM's stacked LoRA tensors in place
(`vllm_compat.lora_buffers`), so nothing is read from disk again and the captured graphs, which read those tensors
by address, run the new adapter. Generate calls name the adapter (`request`).

Numerics: vLLM keeps A and s B in the engine's dtype (B scaled once, in fp32, then rounded), accumulates x A^T in
fp32, rounds it to the engine's dtype and expands it with s B; the policy computes the same roundings
(`qarl.lora.adapter_output`), so the two differ only in the order of the sums (the parity table measures it).

Where vLLM's LoRA cannot serve the run (`hooks_needed`), the engine merges the adapters into its weights where a merge
can serve it (`merges_adapters`, `policy.generation.qlora_adapters=auto`) and keeps its graphs, or else adds them by
forward hooks (qarl/generation/adapters.py), eagerly.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.generation import vllm_compat
from qarl.generation.adapters import engine_part
from qarl.lora import adapter_weights
from qarl.models.experts import config_has_experts
from qarl.quant import QuantFormat
from qarl.quant.ops import input_quant_plan, layer_inputs

ADAPTER_ID, ADAPTER_NAME = 1, "qarl-policy"
_PARTS = ("lora_A", "lora_B")


def hooks_needed(rank: int, dtype: str, quantized_inputs: bool, experts: bool = False) -> str | None:
    """Why vLLM's LoRA cannot serve adapters of `rank` in an engine of `dtype` (None: it can); `experts`: the model
    has Mixture-of-Experts layers."""
    if experts and not torch.cuda.is_available():
        return "vLLM's LoRA layer for fused MoE experts runs Triton kernels, which its CPU platform lacks"
    if experts:  # vllm_compat.experts_in_changed_layout names the method; seen on an H100 with vLLM 0.26
        return ("vLLM's LoRA computes a MoE layer's experts with its modular fused-MoE method, whose expert layout "
                "qarl's refit has not been checked against")
    if quantized_inputs:
        return ("the engine quantizes layer inputs (an activation format), and vLLM's LoRA layers call the base "
                "layer's kernel directly, past qarl's quantized input")
    if torch.cuda.is_available() and dtype == "float32":
        return "vLLM's GPU LoRA kernels take fp16 and bf16 only"
    if rank > max(vllm_compat.lora_ranks()):
        return f"rank {rank} is above the largest rank vLLM serves ({max(vllm_compat.lora_ranks())})"
    return None


def engine_adapter_rank(lora: LoraConfig | None) -> int:
    """The rank of the adapters a policy with `lora` brings to the engine (0: none: only qlora serves adapters)."""
    return lora.rank if lora is not None and lora.mode == "qlora" else 0


def merges_adapters(cfg: PolicyConfig, model_dir: str, fmt: QuantFormat | None, packed_base: bool) -> bool:
    """Whether the training engine of a policy of `cfg` (on `model_dir`, serving `fmt`; `packed_base`: its base
    packed) folds its qlora adapters into its weights instead of computing them beside the base
    (`policy.generation.qlora_adapters`): "merged" always (refused where a merge cannot serve the format), "lora"
    never, "auto" where vLLM's LoRA cannot serve the adapters (`hooks_needed`) and a merge can (a format that quantizes
    no layer input, a base held folded): a merging engine keeps its CUDA graphs, where qarl's hooks run it eagerly."""
    mode = cfg.generation.qlora_adapters
    if cfg.lora.mode != "qlora" or mode == "lora":
        return False
    if mode == "merged":
        return True
    if packed_base or hooks_needed(cfg.lora.rank, cfg.dtype, False, config_has_experts(model_dir)) is None:
        return False
    # (the plan is built, from a quantized meta model, only where a merge is in question)
    return not layer_inputs(input_quant_plan(model_dir, fmt))


def check_merged_adapters(merging: bool, quantized_inputs: bool) -> None:
    """Merged adapters compute what the policy does only where a layer's input reaches the adapter unquantized: the
    policy computes fq(x) Q(W)^T + s B A x, an engine holding Q(W) + s B A would compute fq(x) (Q(W) + s B A)^T."""
    if merging and quantized_inputs:
        raise ConfigError("policy.generation.qlora_adapters=merged cannot serve a format that quantizes layer inputs: "
                          "the engine would feed the adapters the quantized input, where the policy feeds them the "
                          "input itself. Use policy.generation.qlora_adapters=lora")


def training_engine_rank(cfg: PolicyConfig, merging: bool) -> int:
    """The adapter rank the engine of a training or QAD run of `cfg` serves (0: it merges the adapters, `merging`, or
    there are none)."""
    return 0 if merging else engine_adapter_rank(cfg.lora)


def engine_options(rank: int) -> dict:
    """vLLM's settings for one adapter of `rank` (its max_lora_rank rounded up; smaller ranks are zero-padded)."""
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
            "max_lora_rank": next(r for r in vllm_compat.lora_ranks() if r >= rank)}


class VLLMAdapters:
    """`load(adapters, policy_modules)` -> bytes copied; `ensure_active()` before each generate, which passes
    `request`."""

    def __init__(self, llm, worker, model: nn.Module, dtype: str):
        self.llm, self.worker, self.model, self.dtype = llm, worker, model, getattr(torch, dtype)
        self.layers = vllm_compat.lora_wrappers(worker)
        self.packed = vllm_compat.packed_modules(model)
        self.registered = None  # vLLM's request for the adapter, once loaded
        self.shape: dict[str, int] = {}  # policy layer -> rank, of the adapter registered (what the slot holds)
        self.active = False  # the last load brought adapters
        self.dir: Path | None = None
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # policy layer -> (A, s B) as the engine holds them

    def unwrapped(self):
        """The model with vLLM's LoRA layers replaced by the layers they wrap, for loading base weights by name."""
        return vllm_compat.lora_unwrapped(self.model, self.layers)

    def _place(self, policy_name: str) -> tuple[nn.Module, int]:
        """(the vLLM LoRA layer, the part's index in it) of a policy layer: fused parts in vLLM's order."""
        engine_name, before = engine_part(self.packed, policy_name)
        if engine_name not in self.layers:
            raise RuntimeError(f"vLLM's LoRA has no layer for the policy's adapted layer {policy_name}")
        return self.layers[engine_name], len(before)

    @torch.no_grad()
    def load(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
             policy_modules: dict[str, nn.Module]) -> int:
        """Make the engine's adapter equal `adapters` ({policy layer: (A, B, s)}); returns bytes copied."""
        self.active = bool(adapters)
        if not adapters:  # a policy without adapters: generate calls run the base alone
            return 0
        shape = {name: a.shape[0] for name, (a, _, _) in adapters.items()}
        if self.shape and shape != self.shape:  # parts of the slot the new adapter leaves out would keep old values
            raise RuntimeError("this engine's vLLM LoRA slot holds an adapter of other layers or ranks than the policy's; "
                               "an engine serves one adapter layout (start another engine for another policy.lora)")
        device = vllm_compat.lora_buffers(next(iter(self.layers.values())))[0][0].device
        self.held = {name: tuple(t.to(device) for t in adapter_weights(a, b, scale, self.dtype))
                     for name, (a, b, scale) in adapters.items()}
        if self.registered is None:
            self._register(adapters)
            self.shape = shape
        self.ensure_active(copy=True)
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in adapters.values())

    def _register(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Write the adapter as a PEFT directory and have vLLM load and pin it (once per engine)."""
        from safetensors.torch import save_file

        ranks = {a.shape[0] for a, _, _ in adapters.values()}
        scales = {s for _, _, s in adapters.values()}
        if len(ranks) != 1 or len(scales) != 1:
            raise RuntimeError(f"vLLM's LoRA serves one rank and one scale per adapter; the policy has ranks {ranks}, "
                               f"scales {scales}")
        rank, scale = ranks.pop(), scales.pop()
        self.dir = Path(tempfile.mkdtemp(prefix="qarl-lora-"))
        tensors = {f"base_model.model.{name}.{part}.weight": t.detach().float().cpu().contiguous()
                   for name, pair in adapters.items() for part, t in zip(_PARTS, pair[:2])}
        save_file(tensors, str(self.dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "bias": "none",
                  "target_modules": sorted({n.rpartition(".")[2] for n in adapters}), "task_type": "CAUSAL_LM"}
        (self.dir / "adapter_config.json").write_text(json.dumps(config))
        self.registered = vllm_compat.lora_request(ADAPTER_NAME, ADAPTER_ID, str(self.dir))

    @torch.no_grad()
    def ensure_active(self, copy: bool = False) -> None:
        """The adapter in its slot, holding the last load (before each generate): loaded and pinned again where vLLM
        holds it nowhere (the first load; vLLM clears its slots after dummy runs), and then, or when `copy`, the
        held tensors copied into the slot."""
        if not self.active:
            return
        slot = vllm_compat.lora_slot(self.worker, ADAPTER_ID)
        if slot is None:
            vllm_compat.add_pinned_lora(self.llm, self.registered)
            slot, copy = vllm_compat.lora_slot(self.worker, ADAPTER_ID), True
        if not copy:
            return
        for name, (lora_a, lora_b) in self.held.items():
            layer, part = self._place(name)
            vllm_compat.write_lora_slot(layer, part, slot, lora_a, lora_b)

    @property
    def request(self):
        """What a generate call passes as its `lora_request`: the adapter, or None where the policy has none."""
        return self.registered if self.active else None

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
