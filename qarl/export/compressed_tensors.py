"""compressed-tensors: the format llm-compressor writes and transformers and vLLM load
(quant_method "compressed-tensors").

Per quantized linear `L` (as compressed-tensors 0.17's compressors name and shape them):
  NVFP4 ("nvfp4-pack-quantized", presets NVFP4A16 / NVFP4):
          L.weight_packed        uint8 [out, in/2]   two E2M1 codes per byte, low nibble = even element
          L.weight_scale         float8_e4m3fn [out, in/16]
          L.weight_global_scale  float32 [1]   a DIVISOR: weight = E2M1 * (weight_scale / weight_global_scale)
          L.input_global_scale   float32 [1]   (W4A4 only) also a divisor, ~ 6 * 448 / input amax
  FP8 ("float-quantized", preset FP8):
          L.weight       float8_e4m3fn [out, in];  L.weight_scale, L.input_scale float32 [1]
          weight = E4M3 * weight_scale   (a multiplier, like ModelOpt's)
An FP8 KV cache: A.k_scale, A.v_scale float32 [1] per attention module A (dequantization scales), and
`kv_cache_scheme` in the quantization config.

The NVFP4 global scale is where this format cannot always hold the training kernel's numbers: the
kernel multiplies by g = amax * fl(1/2688), the format divides by weight_global_scale, and in general
no fp32 divisor G gives fl(e / G) == fl(e * g) for every E4M3 block scale e. We store the G near 1/g
that reproduces the most of the layer's weights (`codes.best_divisor`) and report the rest as
`differing` in the summary. Each is off by one or two fp32 ulps: the block scale is one ulp off, times
an E2M1 value. The E2M1 codes and E4M3 block scales are exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qarl.quant.codes import FP8Weight, best_divisor, fp8_kernel_scale, kernel_global_scale, stacked

PRESET = {"nvfp4_w4a16": "NVFP4A16", "nvfp4_w4a4": "NVFP4", "fp8_w8a8": "FP8"}
FORMAT = {"nvfp4_w4a16": "nvfp4-pack-quantized", "nvfp4_w4a4": "nvfp4-pack-quantized", "fp8_w8a8": "float-quantized"}


def layer_tensors(layer, siblings: list) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of one quantized layer, by their checkpoint names; `siblings`: the layers an engine fuses it
    with (itself included), which share its scales. The NVFP4 global divisor is chosen for all of them
    together, so that they keep one."""
    w, p = layer.weight, layer.name
    if isinstance(w, FP8Weight):
        out = {f"{p}.weight": w.codes, f"{p}.weight_scale": w.scale.reshape(1)}
        if layer.input_amax is not None:
            out[f"{p}.input_scale"] = fp8_kernel_scale(layer.input_amax, w.kernel).reshape(1)
        return out, {"differing": 0, "fp8_kernel": w.kernel}
    divisor = best_divisor(stacked([s.weight for s in siblings]), layer.dtype)[0]
    differing = best_divisor(w, layer.dtype, candidates=[divisor])[1]
    out = {f"{p}.weight_packed": w.packed, f"{p}.weight_scale": w.block_scale,
           f"{p}.weight_global_scale": divisor.reshape(1)}
    if layer.input_amax is not None:
        out[f"{p}.input_global_scale"] = (1.0 / kernel_global_scale(layer.input_amax).double()).float().reshape(1)
    return out, {"differing": differing}


def kv_cache_tensors(attention: str, key_scale: torch.Tensor, value_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """An attention layer's FP8 KV cache scales as compressed-tensors names them (`<attention>.k_scale`, `v_scale`,
    fp32 [1]), which vLLM maps onto its attention layer's k_scale and v_scale."""
    return {f"{attention}.k_scale": key_scale.reshape(1), f"{attention}.v_scale": value_scale.reshape(1)}


def write_config(out_dir: Path, model: torch.nn.Module, layers: dict, scheme: str, kv_cache: bool) -> dict[str, Any]:
    """config.json's `quantization_config`, built from compressed-tensors' own schema objects and laid
    out as its ModelCompressor.update_config writes it. Every linear layer that is not exported quantized
    (e.g. lm_head, a MoE router, which transformers holds as its own module with a 2-D weight) is listed in
    `ignore`, where vLLM looks before it builds a layer quantized. An FP8 KV cache adds `kv_cache_scheme` (FP8,
    per-tensor, symmetric, static). A mixed export (`scheme` nvfp4_w4a4+fp8_w8a8) has a config group per scheme its
    layers have, each naming its layers (a class target beside names would leave compressed-tensors warning that the
    names it matched through the class matched nothing) with its own format, under the config's "mixed-precision"."""
    import compressed_tensors
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationStatus,
                                                 preset_name_to_scheme)

    from qarl.export.targets import scheme_parts

    def linear(module: torch.nn.Module) -> bool:
        weight = module._parameters.get("weight")
        return isinstance(module, torch.nn.Linear) or (
            weight is not None and weight.dim() == 2 and not isinstance(module, torch.nn.Embedding))

    ignore = sorted(name for name, module in model.named_modules() if linear(module) and name not in layers)
    parts = [part for part in scheme_parts(scheme) if any(layer.scheme == part for layer in layers.values())]
    groups = {}
    for i, part in enumerate(parts):
        targets = ["Linear"] if len(parts) == 1 else sorted(n for n, layer in layers.items() if layer.scheme == part)
        groups[f"group_{i}"] = preset_name_to_scheme(PRESET[part], targets)
        groups[f"group_{i}"].format = FORMAT[part]
    formats = {FORMAT[part] for part in parts}
    kv_cache_scheme = (QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
                       if kv_cache else None)  # (the scheme vLLM's compressed-tensors loader takes)
    quant = QuantizationConfig(config_groups=groups, format=formats.pop() if len(formats) == 1 else "mixed-precision",
                               kv_cache_scheme=kv_cache_scheme, quantization_status=QuantizationStatus.COMPRESSED,
                               ignore=ignore)
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **quant.model_dump(mode="json", exclude={"quant_method"}),
    }


# --- reading (for the verifier) -------------------------------------------------------------------


def read_weights(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{layer name: its stored tensors} of every quantized layer in a loaded state dict."""
    names = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    keep = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "input_scale", "input_global_scale")
    return {n: {k: tensors[f"{n}.{k}"] for k in keep if f"{n}.{k}" in tensors} for n in names}


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The format's definition in fp32 (compressed-tensors' own decompressor returns bf16 for NVFP4)."""
    if "weight_packed" not in parts:
        return (parts["weight"].float() * parts["weight_scale"].float()).to(dtype)
    packed = parts["weight_packed"]
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    values = e2m1[codes].view(*codes.shape[:-1], -1, 16)
    block = parts["weight_scale"].float() / parts["weight_global_scale"].float()
    return (values * block.unsqueeze(-1)).flatten(-2).to(dtype)
