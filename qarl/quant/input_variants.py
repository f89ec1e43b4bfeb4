"""NVFP4 layer inputs quantized in ways ModelOpt's formats do not have, to cut W4A4's activation error:

- **per-token scales**: each row (token) of a layer's input gets its own fp32 second-level scale from its own max,
  instead of the one per-tensor scale from the calibrated amax: a token with small activations is not quantized on
  the grid of the layer's largest token;
- **4-over-6 block scales**: each block of 16 is scaled so that its max maps to 6 (the format as shipped) or to 4,
  whichever gives the smaller squared error of the block (the E2M1 grid is finer near 4: 3 and 4 exist, 5 does not).
- **Hadamard-rotated blocks** (with per-token scales): each block of 16 is rotated by the normalized 16-point Hadamard
  matrix before it is quantized and rotated back after, so an outlier's magnitude is spread over its block; the
  rotation is online, on the input alone (QuaRot's online rotation, without folding anything into the weights).

A quant config chooses them on an input quantizer as a ModelOpt quantization backend (ModelOpt's public
`register_quant_backend`), with the NVFP4 settings kept so that every part of qarl reads the format as NVFP4::

    - quantizer_name: '*input_quantizer'
      cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3},
            backend: qarl_nvfp4, backend_extra_args: {per_token: true, four_over_six: false, hadamard: false}}

The policy's quantizers (ModelOpt's forward, or qarl's fast path) and the rollout engine's input op
(`qarl.quant.ops.fake_quant_input`) call one function, `fake_quant`, a torch.library op (opaque to the engine's
compiled graph; on a GPU one Triton kernel, `qarl/quant/kernels/nvfp4_variant_gpu.py`, which computes the torch
version here operation for operation). Its contract is its own, not ModelOpt's kernel's: IEEE fp32 throughout
(divisions correctly rounded, sums in a fixed order), so it gives the same bits on CPU and GPU; E4M3 block scales
rounded to nearest even, a zero scale taken as 1; E2M1 codes rounded to nearest, ties to the even code; the result
cast to the input's dtype. The calibrated amax is still calibrated and synced; per-token scales do not read it.

No engine's real NVFP4 W4A4 kernel computes any of them (vLLM's takes one input scale per layer from the checkpoint and
max-mapped block scales): a model trained with them is a training-time result, its export refused by name
(`qarl.export.targets.check_target_matches`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qarl.config import ConfigError
from qarl.quant.kernels.nvfp4_cpu import E4M3_MAX, INV_GLOBAL_SCALE
from qarl.quant.straight_through import StraightThrough

BACKEND = "qarl_nvfp4"  # the ModelOpt backend name a quant config gives an input quantizer
OPTIONS = ("per_token", "four_over_six", "hadamard")  # its backend_extra_args, each a bool
BLOCK = 16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index parity = the code's mantissa bit: ties go to even


@dataclass(frozen=True)
class Variant:
    """Which of them an input quantizer uses (at least one; hadamard with per_token)."""

    per_token: bool = False
    four_over_six: bool = False
    hadamard: bool = False


def variant_of(quantizer: Any) -> Variant | None:
    """The `Variant` of a ModelOpt quantizer (or a quant config's `cfg` dict) whose backend is this one, else None."""
    get = quantizer.get if isinstance(quantizer, dict) else lambda key: getattr(quantizer, key, None)
    if get("backend") != BACKEND:
        return None
    args = get("backend_extra_args") or {}
    return Variant(**{key: bool(args.get(key, False)) for key in OPTIONS})


def check_config(quant_cfg: list[dict], source: str) -> None:
    """Every entry of a quant config that names this backend: on input quantizers only, NVFP4 block-16 dynamic
    settings, known options, at least one on. Anything else is a ConfigError naming the entry and the fix."""
    for entry in quant_cfg:
        cfg = entry.get("cfg")
        if not isinstance(cfg, dict) or cfg.get("backend") != BACKEND:
            continue
        name = entry.get("quantizer_name", "")
        where = f"quant config {source}, entry {name!r}"
        if not name.endswith("input_quantizer"):
            raise ConfigError(f"{where}: backend {BACKEND} quantizes layer inputs only (per-token scales, 4-over-6 "
                              "block scales, Hadamard-rotated blocks of activations); name an '*input_quantizer', keep "
                              "the weights' NVFP4 as is")
        args = cfg.get("backend_extra_args") or {}
        unknown = sorted(set(args) - set(OPTIONS))
        if unknown or not all(isinstance(v, bool) for v in args.values()) or not any(args.values()):
            unknown_text = f"; unknown: {', '.join(unknown)}" if unknown else ""
            raise ConfigError(f"{where}: backend_extra_args {args} must set {', '.join(OPTIONS[:-1])} and/or "
                              f"{OPTIONS[-1]} to true (booleans{unknown_text})")
        if args.get("hadamard") and not args.get("per_token"):
            raise ConfigError(f"{where}: hadamard rotates each block before it is quantized, so the calibrated amax "
                              "(of the unrotated inputs) no longer bounds it: set per_token: true beside it")
        sizes = {str(k): v for k, v in (cfg.get("block_sizes") or {}).items()}
        bits = tuple(cfg["num_bits"]) if isinstance(cfg.get("num_bits"), (list, tuple)) else cfg.get("num_bits")
        scale_bits = sizes.get("scale_bits")
        if bits != (2, 1) or sizes.get("-1") != BLOCK or sizes.get("type") != "dynamic" or \
                tuple(scale_bits or ()) != (4, 3):
            raise ConfigError(f"{where}: backend {BACKEND} is NVFP4; give it num_bits: e2m1 and block_sizes: "
                              "{-1: 16, type: dynamic, scale_bits: e4m3}, as the plain NVFP4 input quantizer has")


@functools.lru_cache(maxsize=8)
def _grid(device: torch.device) -> torch.Tensor:
    """The E2M1 values on `device`, made once: a copy from the host inside a CUDA graph's capture would fail."""
    return torch.tensor(_E2M1, device=device)


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    """|x| / scale (>= 0, fp32) to the nearest E2M1 value, ties to the even code."""
    grid = _grid(v.device)
    v = v.clamp(max=6.0)
    low = (torch.bucketize(v, grid, right=True) - 1).clamp(0, len(_E2M1) - 2)
    below, above = v - grid[low], grid[low + 1] - v
    up = (above < below) | ((above == below) & (low % 2 == 1))  # low odd: low + 1 is the even code
    return torch.where(up, grid[low + 1], grid[low])


def _mapped(blocks: torch.Tensor, global_scale: torch.Tensor, top: float) -> torch.Tensor:
    """NVFP4 quantize-dequantize of |blocks| [..., n, 16] with each block's max mapped to `top` (6 or 4)."""
    block_max = blocks.amax(-1, keepdim=True)
    scale = (block_max / (global_scale * top)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _e2m1(blocks / scale) * scale


def _squared_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) of (a - b)^2, added in index order: no reduction whose order a device chooses."""
    d = (a - b) * (a - b)
    total = d[..., 0]
    for i in range(1, d.shape[-1]):
        total = total + d[..., i]
    return total.unsqueeze(-1)


def _hadamard(blocks: torch.Tensor) -> torch.Tensor:
    """Each block of 16 times the normalized Hadamard matrix H/4 (symmetric, its own inverse): a fast Walsh-Hadamard
    transform of four butterfly stages, each an elementwise sum or difference in a fixed order, then x 1/4 (exact):
    the same bits on any device and for any number of rows, which a matmul would not promise."""
    out, half = blocks, 1
    while half < BLOCK:
        pairs = out.reshape(*out.shape[:-1], BLOCK // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        out = torch.stack((a + b, a - b), dim=-2).reshape(blocks.shape)
        half *= 2
    return out * 0.25


def fake_quant_reference(x: torch.Tensor, amax: torch.Tensor, per_token: bool, four_over_six: bool,
                         hadamard: bool) -> torch.Tensor:
    """The contract above in torch: the op's implementation on CPU, and what its GPU kernel is checked against."""
    if x.numel() == 0:
        return x.clone()
    width = x.shape[-1]
    x32 = F.pad(x.float(), (0, -width % BLOCK))
    blocks = x32.reshape(*x32.shape[:-1], -1, BLOCK)
    if hadamard:
        blocks = _hadamard(blocks)
    magnitude = blocks.abs()
    if per_token:
        row_max = magnitude.amax(dim=(-2, -1), keepdim=True)
    else:
        row_max = amax.detach().float().reshape(()).to(x.device)
    global_scale = row_max * INV_GLOBAL_SCALE
    global_scale = torch.where(global_scale > 0, global_scale, torch.full_like(global_scale, 1e-12))
    quantized = _mapped(magnitude, global_scale, 6.0)
    if four_over_six:
        four = _mapped(magnitude, global_scale, 4.0)
        better = _squared_error(four, magnitude) < _squared_error(quantized, magnitude)
        quantized = torch.where(better, four, quantized)
    out = torch.where(blocks < 0, -quantized, quantized)
    if hadamard:
        out = _hadamard(out)  # back: the layer multiplies the input in its own basis
    return out.reshape(x32.shape)[..., :width].to(x.dtype)


@torch.library.custom_op("qarl::nvfp4_input_variant", mutates_args=())
def _op(x: torch.Tensor, amax: torch.Tensor, per_token: bool, four_over_six: bool, hadamard: bool) -> torch.Tensor:
    return fake_quant_reference(x.contiguous(), amax, per_token, four_over_six, hadamard)


@_op.register_kernel("cuda")
def _(x: torch.Tensor, amax: torch.Tensor, per_token: bool, four_over_six: bool, hadamard: bool) -> torch.Tensor:
    """On a GPU the same function as one Triton kernel (the torch version above is dozens of launches a call)."""
    from qarl.quant.kernels import nvfp4_variant_gpu

    return nvfp4_variant_gpu.fake_quant(x.contiguous(), amax, per_token, four_over_six, hadamard)


@_op.register_fake
def _(x: torch.Tensor, amax: torch.Tensor, per_token: bool, four_over_six: bool, hadamard: bool) -> torch.Tensor:
    return torch.empty_like(x)


def fake_quant(x: torch.Tensor, amax: torch.Tensor, variant: Variant) -> torch.Tensor:
    """`x` NVFP4-quantized-dequantized as `variant` says, no gradient (callers add the straight-through one)."""
    return _op(x, amax, variant.per_token, variant.four_over_six, variant.hadamard)


def _modelopt_backend(inputs: torch.Tensor, quantizer: Any) -> torch.Tensor:
    """ModelOpt's entrypoint for an input quantizer with `backend: qarl_nvfp4`: the fake quantization above with
    ModelOpt's straight-through gradient (pass-through)."""
    variant = variant_of(quantizer)
    amax = getattr(quantizer, "amax", None)
    if amax is None:
        if not variant.per_token:
            raise RuntimeError(f"{BACKEND}: an input quantizer with 4-over-6 block scales and a per-tensor scale "
                               "quantized before its amax was calibrated")
        amax = inputs.new_ones((), dtype=torch.float32)
    quantized = fake_quant(inputs.detach(), amax, variant)
    return StraightThrough.apply(inputs, quantized, None) if inputs.requires_grad else quantized


def register() -> None:
    """Register the backend with ModelOpt (once per process): before any quantizer that names it runs."""
    from modelopt.torch.quantization.nn import is_registered_quant_backend, register_quant_backend

    if not is_registered_quant_backend(BACKEND):
        register_quant_backend(BACKEND, _modelopt_backend)
