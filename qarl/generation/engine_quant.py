"""Input quantization inside vLLM's own linear layers, installed before vLLM compiles and captures.

A weight-only format (NVFP4 W4A16) needs nothing here: the engine is a plain vLLM model serving the
folded weights. For an activation format each (fused) linear layer whose input is quantized gets a
subclass of its own vLLM class (`qarl.quant.mixins.with_mixin`) that calls one fake-quant op on its
input (`qarl.quant.ops.fake_quant_input`) and then vLLM's own forward. Its amax is a buffer of
the layer, written in place by every refit, so a captured CUDA graph reads the new value; fused
siblings (q/k/v, gate/up) share one amax on the policy side and so in the engine. A MoE layer's experts share
one input quantizer per projection on the policy side (ModelOpt's fused experts); the engine's MoE layer gets
one `ExpertInput` per projection, which vLLM's experts call (`vllm_compat.EXPERT_INPUTS`; CPU only). A format that
quantizes the attention's keys and values (ModelOpt's k/v_bmm_quantizer) gives each engine attention layer its
`KVCacheScales`: the engine runs an FP8 KV cache (`kv_cache_dtype="fp8"`) whose scales every refit writes.

The layers are installed by qarl's model loader ("qarl", vLLM's load-format seam) right after the
weights load, i.e. before vLLM traces the model and captures its graphs. The plan travels in vLLM's
`additional_config`, which is part of vLLM's compilation cache key: an engine never reuses a graph
compiled for another format. An eager engine may also change its plan in place (`install`/`uninstall`).
"""

from __future__ import annotations

import torch
from torch import nn

from qarl.config import ConfigError
from qarl.generation import exact, vllm_compat
from qarl.quant.kernels import install as install_kernels
from qarl.quant.mixins import with_mixin, without_mixin
from qarl.quant.codes import decode_fp8_codes, fp8_codes, fp8_kv_cache_multipliers
from qarl.quant.ops import (EXPERT_INPUT_QUANTIZERS, KV_CACHE, InputQuant, expert_input_key, fake_quant_input,
                            is_expert_input, is_kv_cache, kv_cache_key)

PLAN_KEY = "qarl_input_quant"  # vLLM additional_config key: {HF layer name: InputQuant.as_dict()}
LOAD_FORMAT = "qarl"


class QuantizedInput:
    """Mixed into a vLLM linear layer's class: y = layer(fake_quant(x)), the amax a buffer of the layer."""

    input_quant: InputQuant

    def forward(self, input_):
        quantized = fake_quant_input(input_, self.input_amax, self.input_quant, self.input_pre_quant_scale)
        return super().forward(quantized)


class ExpertInput(nn.Module):
    """The fake quantization of one projection's input in an engine's MoE layer, for all its experts (the policy's
    experts share one input quantizer per projection): called by vLLM's experts, its amax written by every refit."""

    def __init__(self, spec: InputQuant, policy_name: str, device: torch.device):
        super().__init__()
        self.input_quant, self.policy_name = spec, policy_name  # policy_name: the plan's key (`expert_input_key`)
        self.register_buffer("input_amax", torch.zeros((), dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_input(x, self.input_amax, self.input_quant)


class KVCacheScales(nn.Module):
    """The FP8 KV cache scales of one engine attention layer (vLLM's `Attention`), from the policy's key and value
    amax, written in place by every refit: ModelOpt's FP8 scale 448 / amax as its kernel rounds it (`multiplier`,
    keys then values) and its reciprocal (`scale`), which is the dequantization scale vLLM's
    `k_scale` / `v_scale` hold (`vllm_compat.write_kv_cache_scales`). On CPU qarl's attention stores each key and
    value row as the E4M3 codes ModelOpt's fake quant rounds it to and reads them back times `scale`: the
    policy's quantized keys and values to the bit. Until the first refit the scales are 1 (amax 448), vLLM's own
    default."""

    def __init__(self, policy_name: str, device: torch.device):
        super().__init__()
        self.policy_name = policy_name  # the policy's attention module
        self.register_buffer("multiplier", torch.ones(2, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(2, dtype=torch.float32, device=device))

    def load_amax(self, key_amax: torch.Tensor, value_amax: torch.Tensor) -> None:
        """The scales of the policy's key and value amax, in place, as the kernel of the policy's device rounds them
        (`fp8_kernel_multiplier`: ModelOpt's CPU path multiplies by the reciprocal, its CUDA extension divides)."""
        self.multiplier.copy_(fp8_kv_cache_multipliers(key_amax, value_amax, self.multiplier.device))
        self.scale.copy_(torch.reciprocal(self.multiplier))

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Rows of [tokens, key heads, head dim] keys and values -> their cache rows, [tokens, key heads, 2 x head
        dim] bytes (E4M3 codes: the keys', then the values')."""
        codes = torch.cat([fp8_codes(key, self.multiplier[0]), fp8_codes(value, self.multiplier[1])], -1)
        return codes.view(torch.uint8)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows of bytes [..., 2 x head dim] -> (keys, values) in `dtype`."""
        key, value = rows.view(torch.float8_e4m3fn).chunk(2, -1)
        return decode_fp8_codes(key, self.scale[0], dtype), decode_fp8_codes(value, self.scale[1], dtype)


def _kv_caches(model: nn.Module, plan: dict[str, InputQuant]) -> list[tuple[nn.Module, str]]:
    """(engine attention layer, the policy's attention module name) of every KV cache `plan` quantizes; every one must
    exist in the engine."""
    wanted = [key.removesuffix("." + KV_CACHE) for key in plan if is_kv_cache(key)]
    if not wanted:
        return []
    layers = vllm_compat.attention_layers(model)
    missing = [name for name in wanted if name not in layers]
    if missing:
        raise ConfigError(f"the format quantizes the KV cache of {missing[:4]}, which the engine has no attention "
                          "layer for under these names")
    return [(layers[name], name) for name in wanted]


def _expert_inputs(model: nn.Module, plan: dict[str, InputQuant]) -> list[tuple[nn.Module, str, str]]:
    """(engine MoE layer, its attribute for an `ExpertInput`, the plan key) of each projection of each MoE layer
    whose input `plan` quantizes."""
    return [(module, attribute, expert_input_key(name, quantizer))
            for name, module in vllm_compat.expert_layers(model).items()
            for quantizer, attribute in zip(EXPERT_INPUT_QUANTIZERS, vllm_compat.EXPERT_INPUTS)
            if expert_input_key(name, quantizer) in plan]


def _quantized_input_class(cls: type) -> type:
    return with_mixin(QuantizedInput, cls, "QuantizedInput", globals())


def policy_names(model: nn.Module, engine_name: str) -> list[str]:
    """The Hugging Face layers an engine layer stands for: the parts of a fused layer, or itself."""
    parent, _, leaf = engine_name.rpartition(".")
    parts = vllm_compat.packed_modules(model).get(leaf)
    return [f"{parent}.{p}" for p in parts] if parts else [engine_name]


def install(model: nn.Module, plan: dict[str, InputQuant]) -> int:
    """Give every engine linear layer whose input `plan` quantizes the quantized-input forward, and every MoE layer
    whose experts' inputs it quantizes an `ExpertInput` per projection; returns how many. Fused parts must agree,
    and every planned layer must exist in the engine: both are checked before any layer changes."""
    linear_layer = vllm_compat.linear_layer_class()
    chosen, covered = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, linear_layer):
            continue
        parts = policy_names(model, name)
        specs = {plan.get(p) for p in parts}
        covered.update(p for p in parts if p in plan)
        if len(specs) != 1:
            raise ConfigError(f"engine layer {name} fuses {parts}, which the format quantizes differently "
                              f"({[plan.get(p) for p in parts]}); one fused matrix takes one input quantizer")
        if specs != {None}:
            chosen.append((module, specs.pop()))
    experts = _expert_inputs(model, plan)
    covered.update(key for _, _, key in experts)
    kv_caches = _kv_caches(model, plan)
    covered.update(kv_cache_key(name) for _, name in kv_caches)
    missing = sorted(set(plan) - covered)
    if missing_experts := [key for key in missing if is_expert_input(key)]:
        raise ConfigError(f"the format quantizes the experts' inputs of {missing_experts[:4]}, whose MoE layers the "
                          "engine does not have under these names")
    unread = sorted({key.rpartition(".")[0] for module, _, key in experts
                     if not vllm_compat.experts_read_inputs(module)})
    if unread:
        raise ConfigError(f"the engine's experts of {unread[:4]} are not computed by qarl's plain experts, which "
                          "quantize their inputs (vllm_compat.keep_cpu_experts_plain): quantize the experts' weights "
                          "only (nvfp4_a16)")
    if missing:
        raise ConfigError(f"the format quantizes the inputs of {missing[:4]}, which the engine has no linear "
                          "layer for (e.g. lm_head); keep them unquantized in the quant config (enable: false)")
    if chosen:
        install_kernels()
    for module, spec in chosen:
        module.__class__ = _quantized_input_class(type(module))
        module.input_quant = spec
        module.register_buffer("input_amax", torch.zeros((), dtype=torch.float32, device=module.weight.device))
        module.register_buffer("input_pre_quant_scale", None)
    for module, attribute, key in experts:
        setattr(module, attribute, ExpertInput(plan[key], key, module.w13_weight.device))
    for layer, name in kv_caches:
        vllm_compat.attach_kv_cache_scales(layer, KVCacheScales(name, vllm_compat.kv_cache_scale_device(layer)))
    return len(chosen) + len(experts) + len(kv_caches)


def uninstall(model: nn.Module) -> None:
    """Back to vLLM's own layers (an eager engine changing format)."""
    for module in list(model.modules()):
        if isinstance(module, QuantizedInput):
            module.__class__ = without_mixin(type(module))  # QuantizedInputX -> X
            del module.input_quant, module.input_amax, module.input_pre_quant_scale
        for attribute in vllm_compat.EXPERT_INPUTS:
            if isinstance(getattr(module, attribute, None), ExpertInput):
                delattr(module, attribute)
        vllm_compat.detach_kv_cache_scales(module)


def plan_to_config(plan: dict[str, InputQuant]) -> dict:
    return {PLAN_KEY: {name: spec.as_dict() for name, spec in sorted(plan.items())}}


_registered = False


def _after_load(model: nn.Module, extra: dict) -> None:
    """What qarl's loader does once vLLM has loaded the weights: `install` the plan in the engine's
    additional_config (`extra`), and the exact forward's kernels if it asks for them."""
    install(model, {name: InputQuant(**spec) for name, spec in extra.get(PLAN_KEY, {}).items()})
    if extra.get(exact.EXACT_KEY):
        exact.install(model)


def register_loader() -> None:
    """vLLM's default loader, then `install` from the plan in the engine's additional_config (idempotent)."""
    global _registered
    if _registered:
        return
    vllm_compat.add_load_format(LOAD_FORMAT, _after_load)
    _registered = True
