"""ModelOpt's unified Hugging Face format: what `modelopt.torch.export.export_hf_checkpoint` writes and
vLLM (quantization "modelopt" / "modelopt_fp4") and TensorRT-LLM load.

Per quantized linear `L` (names, dtypes and shapes as ModelOpt 0.47 writes them):
  NVFP4:  L.weight          uint8 [out, in/2]   two E2M1 codes per byte, low nibble = even element
          L.weight_scale    float8_e4m3fn [out, in/16]   per-block scale
          L.weight_scale_2  float32 []   per-tensor scale; weight = E2M1 * weight_scale * weight_scale_2
          L.input_scale     float32 []   (W4A4 only) activation per-tensor scale, amax / (6 * 448)
  FP8:    L.weight          float8_e4m3fn [out, in];  L.weight_scale, L.input_scale float32 []
          weight = E4M3 * weight_scale
plus `hf_quant_config.json` and the same information as `quantization_config` in config.json. An FP8 KV cache:
          A.k_proj.k_scale, A.v_proj.v_scale  float32 []  per attention module A, the dequantization scales
          (stored = fp8(k / k_scale)), with `kv_cache_quant_algo: "FP8"` in hf_quant_config.json.

Values differ from ModelOpt's own exporter only where that exporter rounds differently from its
training kernel: weight_scale_2 is the kernel's g = amax * fl(1/2688) (ModelOpt writes amax / 2688,
one ulp off for some amax), FP8 weight_scale is the kernel's inv_scale = 1 / (448 / amax) as that
kernel rounds it (ModelOpt writes amax / 448), and the E2M1 codes are the ones the kernel chose, ties
included (ModelOpt's exporter re-rounds with an exact division and ties to even; the kernel multiplies
by the GPU's approximate reciprocal, see qarl/quant/kernels/nvfp4_cpu.py).
See qarl/quant/codes.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qarl.quant.codes import FP8Weight, fp8_kernel_scale, kernel_global_scale

QUANT_ALGO = {"nvfp4_w4a16": "W4A16_NVFP4", "nvfp4_w4a4": "NVFP4", "fp8_w8a8": "FP8"}


def layer_tensors(layer, siblings: list) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of one quantized layer, by their checkpoint names; `siblings`: the layers an engine fuses it
    with (itself included), which share its scales."""
    w, p = layer.weight, layer.name
    if isinstance(w, FP8Weight):
        out = {f"{p}.weight": w.codes, f"{p}.weight_scale": w.scale.reshape(())}
        if layer.input_amax is not None:
            out[f"{p}.input_scale"] = fp8_kernel_scale(layer.input_amax, w.kernel).reshape(())
        return out, {"differing": 0, "fp8_kernel": w.kernel}
    out = {f"{p}.weight": w.packed, f"{p}.weight_scale": w.block_scale,
           f"{p}.weight_scale_2": w.global_scale.reshape(())}
    if layer.input_amax is not None:
        out[f"{p}.input_scale"] = kernel_global_scale(layer.input_amax).reshape(())
    return out, {"differing": 0}


def kv_cache_tensors(attention: str, key_scale: torch.Tensor, value_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """An attention layer's FP8 KV cache scales as ModelOpt's exporter names them (`<attention>.k_proj.k_scale`,
    `v_proj.v_scale`, fp32 []), which vLLM maps onto its attention layer's k_scale and v_scale."""
    return {f"{attention}.k_proj.k_scale": key_scale.reshape(()),
            f"{attention}.v_proj.v_scale": value_scale.reshape(())}


def write_config(out_dir: Path, model: torch.nn.Module, layers: dict, scheme: str, kv_cache: bool) -> dict[str, Any]:
    """Write hf_quant_config.json (ModelOpt's own description of the model) and return config.json's
    `quantization_config`, both made by ModelOpt's functions so the conventions are ModelOpt's (an FP8 KV cache:
    `kv_cache_quant_algo: FP8`, from the model's k/v_bmm_quantizers)."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import get_quant_config

    hf_quant_config = get_quant_config(model)
    algo = hf_quant_config["quantization"].get("quant_algo")
    if algo != QUANT_ALGO[scheme]:
        raise ValueError(f"ModelOpt describes this model as quant_algo={algo!r}, expected {QUANT_ALGO[scheme]!r} "
                         f"for {scheme}: the model's quantizers are not uniform")
    kv_algo = hf_quant_config["quantization"].get("kv_cache_quant_algo")
    if kv_algo != ("FP8" if kv_cache else None):
        raise ValueError(f"ModelOpt describes this model's KV cache as {kv_algo!r}, expected "
                         f"{'FP8' if kv_cache else None!r}")
    (out_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4) + "\n")
    return convert_hf_quant_config_format(hf_quant_config)


# --- reading (for the verifier) -------------------------------------------------------------------


def read_weights(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{layer name: its stored tensors} of every quantized layer in a loaded state dict."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key in tensors:
        if key.endswith(".weight_scale"):
            name = key[: -len(".weight_scale")]
            layers[name] = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")
                            and k[len(name) + 1:] in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    return layers


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The format's definition, written from the spec above (not from qarl's encoder)."""
    weight, scale = parts["weight"], parts["weight_scale"]
    if weight.dtype == torch.float8_e4m3fn:
        return (weight.float() * scale.float()).to(dtype)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.stack([weight & 0x0F, weight >> 4], dim=-1).flatten(-2).long()
    values = e2m1[codes].view(*codes.shape[:-1], -1, 16)
    block = scale.float() * parts["weight_scale_2"].float()
    return (values * block.unsqueeze(-1)).flatten(-2).to(dtype)
