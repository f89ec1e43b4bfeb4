"""The stored form of a fake-quantized weight: its low-precision codes and scales, exactly.

Export writes these codes to disk; a packed frozen base (qarl/quant/packed.py) keeps them in memory instead of
the weight. Encoding and decoding run on the weight's own device. The contract (also in export/README.md):

* Training fake-quantizes with ModelOpt's kernel (GPU) or qarl's bit-identical CPU port
  (`qarl.quant.kernels.nvfp4_cpu`). The exporter never rounds a weight again. It takes the weight the policy
  computes with, ``W_q = weight_quantizer(W)``, and the scales that kernel used, and *encodes*
  ``W_q / scale``, which is exactly representable (E2M1 or E4M3) by construction.
* NVFP4: the kernel's global scale is ``g = amax * fl32(1/2688)`` (a product, as CUDA computes
  ``amax / 2688``), each block of 16 gets an E4M3 scale ``e``, and ``W_q = fl(c * fl(e * g))`` with ``c``
  an E2M1 value. We store ``c`` (packed nibbles, low nibble = even element), ``e`` (float8_e4m3fn) and
  ``g`` (fp32). ModelOpt's unified format dequantizes ``c * (e * weight_scale_2)``: with
  ``weight_scale_2 = g`` that is the kernel's arithmetic, bit for bit.
* FP8: the kernel computes ``scale ~ 448 / amax``, ``inv = fl(1 / scale)`` and
  ``W_q = fl(fp8(W * scale) * inv)``. We store the E4M3 codes and ``weight_scale = inv``. Both formats
  dequantize ``code * weight_scale``, which is again the kernel's arithmetic. ModelOpt's CPU and CUDA
  kernels round ``448 / amax`` differently (`fp8_kernel_scale`); the one that reproduces ``W_q`` is
  stored. ModelOpt's own exporter writes ``amax / 448`` instead, which is often an ulp away from ``inv``.
* Every encode is checked: decoding it must give ``W_q`` bit for bit (sign of zero included), or the
  export stops. Nothing is assumed.

The one representation that cannot always be exact is compressed-tensors' NVFP4 global scale: it is
stored as a divisor (``weight_global_scale`` ~ 2688/amax, dequant ``c * (e / G)``), and no fp32 ``G``
gives ``fl(e / G) == fl(e * g)`` for every E4M3 ``e`` in general. `best_divisor` picks the fp32 ``G``
near ``1/g`` that reproduces the most of the layer's weights and the export reports how many differ
(each by one or two fp32 ulps).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# Midpoints between E2M1 magnitudes: W_q / scale lands on (or within an ulp of) a magnitude, never
# near a midpoint, so nearest-value search by bucketize is unambiguous.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
NVFP4_BLOCK = 16


class FidelityError(RuntimeError):
    """An encoded weight does not decode to the policy's fake-quantized weight."""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality (so -0.0 != +0.0 and NaN == NaN of the same payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(int_type) == b.contiguous().view(int_type)


# --- NVFP4 -----------------------------------------------------------------------------------------


@dataclass
class NVFP4Weight:
    """One NVFP4 weight as stored: packed E2M1 codes, E4M3 block scales, fp32 global scale."""

    packed: torch.Tensor  # uint8 [out, in/2]: low nibble = element 2j, high nibble = element 2j+1
    block_scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor  # fp32 scalar: the kernel's g = amax * fl(1/2688)

    def to(self, device: torch.device | str) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device))

    def rows(self, rows: slice) -> NVFP4Weight:
        """These rows of the weight (one expert's gate or up half of its fused gate/up codes), the global scale the
        same value (a tensor of its own: a checkpoint stores each apart)."""
        return NVFP4Weight(self.packed[rows], self.block_scale[rows], self.global_scale.clone())


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign << 3 | magnitude index) -> uint8, low nibble = even element."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    magnitude = E2M1_VALUES[code & 0x7]
    return torch.where((code & 0x8).bool(), -magnitude, magnitude)


_BYTE = torch.arange(256)
_E2M1_PAIRS = torch.stack([_e2m1_value(_BYTE & 0x0F), _e2m1_value(_BYTE >> 4)], dim=-1)  # byte -> its 2 values


@functools.lru_cache(maxsize=8)
def _pairs_on(device: torch.device) -> torch.Tensor:
    return _E2M1_PAIRS.to(device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> fp32 E2M1 values (twice the last dim), signed zeros kept: one table lookup per byte (a packed
    frozen base is decoded at every forward)."""
    return F.embedding(packed.int(), _pairs_on(packed.device)).flatten(-2)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)


def decode_nvfp4(w: NVFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's definition: c * (e * weight_scale_2), in fp32, then cast to the training dtype."""
    scale = w.block_scale.float() * w.global_scale.float()
    values = _blocks(unpack_e2m1(w.packed)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def decode_nvfp4_divisor(w: NVFP4Weight, divisor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' definition: c * (e / weight_global_scale), in fp32, then the training dtype."""
    scale = w.block_scale.float() / divisor.float()
    values = _blocks(unpack_e2m1(w.packed)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def kernel_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The NVFP4 kernel's fp32 global scale for `amax`, from the kernel port itself."""
    from qarl.quant.kernels.nvfp4_cpu import nvfp4_block_scales

    _, g = nvfp4_block_scales(torch.zeros(1, NVFP4_BLOCK), amax.detach().float().cpu())
    return g.reshape(())


def encode_nvfp4(w_q: torch.Tensor, master: torch.Tensor, amax: torch.Tensor, name: str) -> NVFP4Weight:
    """Encode the fake-quantized weight `w_q` (= weight_quantizer(master)) with the kernel's scales.

    The block scales come from `nvfp4_block_scales(master, amax)`, the same function the CPU kernel
    runs (bit-identical to ModelOpt's Triton kernel). A block whose kernel scale fell below the
    kernel's 1e-5 floor (replaced by 1.0) quantizes to zeros; it is stored with scale 1.0, as
    ModelOpt's exporter stores all-zero blocks.
    """
    from qarl.quant.kernels.nvfp4_cpu import nvfp4_block_scales

    if w_q.ndim != 2 or w_q.shape[-1] % NVFP4_BLOCK:
        raise FidelityError(f"{name}: NVFP4 export needs a 2-D weight with input width divisible by 16, "
                            f"got {tuple(w_q.shape)}")
    s, g = nvfp4_block_scales(master.detach(), amax.detach().to(master.device))  # the CPU port = the GPU kernel
    s, g = s.float(), g.float().reshape(())
    if not (torch.isfinite(g) and g > 0):
        raise FidelityError(f"{name}: weight amax {amax.flatten()[:1].tolist()} gives no usable global scale")
    e = (s / g).to(torch.float8_e4m3fn)  # s = fl(e * g) exactly, so s / g is within an ulp of e
    kernel_block = (e.float() * g) == s
    zero_block = (_blocks(w_q.float()) == 0).all(-1)
    if not (kernel_block | zero_block).all():
        raise FidelityError(f"{name}: {(~(kernel_block | zero_block)).sum()} block scale(s) are not of the "
                            "form E4M3 * global scale and their block is not zero (amax far below the weights?)")
    e = torch.where(kernel_block, e.float(), 1.0).to(torch.float8_e4m3fn)
    scale = (e.float() * g).unsqueeze(-1)
    ratio = (_blocks(w_q.float()) / scale).flatten(-2)
    codes = torch.bucketize(ratio.abs(), _E2M1_MIDPOINTS.to(ratio.device)) | (torch.signbit(ratio).to(torch.long) << 3)
    weight = NVFP4Weight(packed=pack_e2m1(codes), block_scale=e, global_scale=g)
    check_exact(name, decode_nvfp4(weight, w_q.dtype), w_q)
    return weight


def stacked(weights: list[NVFP4Weight]) -> NVFP4Weight:
    """Layers that share a global scale (fused siblings) as one weight, their rows one under the other."""
    return NVFP4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.block_scale for w in weights]),
                       weights[0].global_scale)


def best_divisor(w: NVFP4Weight, dtype: torch.dtype, radius: int = 4,
                 candidates: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """The fp32 divisor G near 1/g whose `c * (e / G)` reproduces the most of the layer's weights.

    Returns (G, number of elements that still differ from the kernel's `c * (e * g)`). Whether an
    element matches depends only on its (block scale, E2M1 code) pair, so candidates are scored on the
    distinct pairs weighted by their counts. Candidates: fl(1/g) and `radius` fp32 neighbours on each
    side (the fewest mismatches wins; fl(1/g) on ties), or the given ones. Widening the radius to 32 found
    nothing better on the embedded model.
    """
    codes = torch.stack([w.packed & 0x0F, w.packed >> 4], dim=-1).flatten(-2).long()
    scale_bits = w.block_scale.view(torch.uint8).long().repeat_interleave(NVFP4_BLOCK, dim=-1)
    counts = torch.bincount((scale_bits * 16 + codes).flatten(), minlength=256 * 16)
    pairs = counts.nonzero().flatten()
    e = (pairs // 16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    c = E2M1_VALUES[pairs % 8] * torch.where(pairs % 16 >= 8, -1.0, 1.0)
    want = (c * (e * w.global_scale.float())).to(dtype)
    if candidates is None:
        start = (1.0 / w.global_scale.double()).float()
        candidates, up, down = [start], start, start
        for _ in range(radius):
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(0.0))
            candidates += [up, down]
    scored = [(int(counts[pairs][~same_bits((c * (e / g_inv)).to(dtype), want)].sum()), i, g_inv)
              for i, g_inv in enumerate(candidates)]
    bad, _, best = min(scored)
    return best.reshape(()), bad


# --- FP8 -------------------------------------------------------------------------------------------


@dataclass
class FP8Weight:
    """One FP8 per-tensor weight as stored: E4M3 codes and the fp32 scale they multiply."""

    codes: torch.Tensor  # float8_e4m3fn, the weight's shape
    scale: torch.Tensor  # fp32 scalar: the kernel's inv_scale = fl(1 / scale)
    kernel: str  # which of ModelOpt's FP8 kernels produced W_q: "cpu" or "cuda" (see fp8_kernel_scale)

    def to(self, device: torch.device | str) -> FP8Weight:
        return FP8Weight(self.codes.to(device), self.scale.to(device), self.kernel)

    def rows(self, rows: slice) -> FP8Weight:
        return FP8Weight(self.codes[rows], self.scale.clone(), self.kernel)


def fp8_kernel_scale(amax: torch.Tensor, kernel: str) -> torch.Tensor:
    """`inv_scale` of ModelOpt's FP8 fake quant: zero amax -> 1, then scale = 448 / amax, inv = 1 / scale.

    ModelOpt's two kernels round `448 / amax` differently. The CPU path (`_fp8_eager`) writes
    `448.0 / amax` in Python, which PyTorch evaluates as `reciprocal(amax) * 448`. The CUDA extension
    (`fake_e4m3fy`) writes `448.f / amax` in C++, which ATen evaluates as a true division. The two
    differ by one ulp for about a quarter of amax values.
    """
    if amax.numel() != 1:
        raise FidelityError(f"FP8 export supports per-tensor amax only, got shape {tuple(amax.shape)}")
    return torch.reciprocal(fp8_kernel_multiplier(amax.detach().cpu().reshape(()), kernel))


def device_kernel(device: torch.device) -> str:
    """Which of ModelOpt's FP8 kernels fake-quantizes on `device` (see `fp8_kernel_scale`): "cuda" or "cpu"."""
    return "cuda" if device.type == "cuda" else "cpu"


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor, kernel: str) -> torch.Tensor:
    """ModelOpt's FP8 fake quant of `x` as `kernel` computes it, on any device: what a run on that kernel's device
    trained with, reproduced on another (an export on the CPU of a model trained on a GPU)."""
    multiplier = fp8_kernel_multiplier(amax.to(x.device), kernel)
    return decode_fp8_codes(fp8_codes(x, multiplier), torch.reciprocal(multiplier), x.dtype)


def fp8_kernel_multiplier(amax: torch.Tensor, kernel: str) -> torch.Tensor:
    """`scale` of ModelOpt's FP8 fake quant, 448 / amax (fp32, zero amax -> 1) as `kernel` rounds it (see
    `fp8_kernel_scale`), elementwise and on amax's device."""
    amax = amax.float()
    safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    return torch.reciprocal(safe) * 448.0 if kernel == "cpu" else torch.full_like(safe, 448.0) / safe


def fp8_kv_cache_multipliers(key_amax: torch.Tensor, value_amax: torch.Tensor,
                             device: torch.device | None = None) -> torch.Tensor:
    """[key's, value's] `fp8_kernel_multiplier` of an FP8 KV cache, computed on `device` (default: the amax's) with
    the kernel of the device the amax lives on (the policy's). Their reciprocals are the dequantization scales the cache
    holds (vLLM's k_scale, v_scale): one rule for the engine's refit and the exact forward's attention."""
    amax = torch.stack([key_amax.reshape(()), value_amax.reshape(())]).to(device or key_amax.device)
    return fp8_kernel_multiplier(amax, device_kernel(key_amax.device))


def fp8_codes(x: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """The E4M3 codes ModelOpt's FP8 fake quant rounds `x` to, given its `fp8_kernel_multiplier`: e4m3(clamp(x *
    scale, +-448)) in fp32. Times the multiplier's reciprocal (`decode_fp8_codes`), they are its output bit for bit
    (tests/unit/test_kv_cache.py): what an FP8 KV cache stores of a key or value row."""
    return (x.float() * multiplier).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def decode_fp8_codes(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`codes` times their dequantization `scale` (the multiplier's reciprocal) in fp32, then `dtype`: the FP8
    definition both export formats and vLLM's FP8 KV cache (k_scale, v_scale) use."""
    return (codes.float() * scale).to(dtype)


def encode_fp8(w_q: torch.Tensor, amax: torch.Tensor, name: str, kernel: str | None = None) -> FP8Weight:
    """Encode `w_q` (= weight_quantizer(W), E4M3 code * inv_scale) back into its E4M3 codes.

    `kernel` (default: the one of the device that computed `w_q`) is tried first, then the other one. Whichever
    decodes to `w_q` exactly is stored (where both do, the scale is the same).
    """
    first = kernel or device_kernel(w_q.device)
    kernels = (first, "cpu" if first == "cuda" else "cuda")
    for kernel in kernels:
        inv = fp8_kernel_scale(amax, kernel)
        inv = inv.to(w_q.device)
        codes = (w_q.float() / inv).to(torch.float8_e4m3fn)  # within an ulp of a code: cast is exact
        weight = FP8Weight(codes=codes, scale=inv, kernel=kernel)
        if kernel == kernels[-1] or same_bits(decode_fp8(weight, w_q.dtype), w_q).all():
            break
    check_exact(name, decode_fp8(weight, w_q.dtype), w_q)
    return weight


def decode_fp8(w: FP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Both formats' definition: code * weight_scale in fp32, then the training dtype."""
    return decode_fp8_codes(w.codes, w.scale.float(), dtype)


def check_exact(name: str, decoded: torch.Tensor, w_q: torch.Tensor) -> None:
    bad = ~same_bits(decoded, w_q)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise FidelityError(
            f"{name}: {int(bad.sum())} of {bad.numel()} exported weights do not decode to the policy's "
            f"fake-quantized weight (first at flat index {i}: {decoded.flatten()[i].item()!r} vs "
            f"{w_q.flatten()[i].item()!r}). The weight quantizer and the export disagree on the format."
        )
