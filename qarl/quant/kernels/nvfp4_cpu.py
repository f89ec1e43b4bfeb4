"""NVFP4 fake quantization in plain torch, bit-identical to ModelOpt's GPU kernels: the dynamic one
(scales from each block's max, below) and the static one (calibrated per-block amax: ModelOpt's MSE
and 4-over-6 formats, `static_nvfp4_fake_quant`).

Contract (ModelOpt 0.47's Triton NVFP4 kernel, behind its block fake-quant op on sm_89+; checked bit for bit
on an H100 by benchmarks/nvfp4_gpu_check.py):

- fp32 arithmetic throughout; the result is cast to ``x.dtype`` (round to nearest even).
- global scale ``g = fl32(amax * fl32(1/2688))`` (CUDA's tensor / scalar); ``g <= 0`` -> 1e-12.
- every ``a / b`` of the kernel is Triton's ``div.full.f32``: ``fl32(a * rcp(b))`` with ``rcp`` the
  GPU's ``rcp.approx.ftz.f32`` (faithful, not correctly rounded), emulated exactly by ``_gpu_rcp``.
- block scale ``s = fl32(e4m3(min(bmax / fl32(6 g), 448)) * g)``, e4m3 rounding to nearest even;
  ``s < 1e-5`` -> 1.0. Blocks are 16 consecutive elements of the last dim (the last one zero-padded).
- ``|x| / s`` is rounded to E2M1 {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to even; the output is
  ``sign(x) * q * s``, except that -0.0 becomes +0.0.
- Ties: a midpoint ``|x| = t * s`` is decided on ``fl32(|x| * rcp(s))``: it rounds down or up as
  ``rcp(s)`` errs below or above ``1/s`` (to even where ``rcp(s) == 1/s``, e.g. ``s`` a power of
  two). Neither always-down nor ties-to-even, and NOT ModelOpt's export path (``NVFP4QTensor``:
  IEEE division, ties to even). Near-ties (within an ulp) follow the same product.
- Finite inputs and amax; NaN inputs are not matched (the kernel's max/min drop NaNs).
"""

from __future__ import annotations

import functools

import torch

from qarl.quant.modelopt_compat import (NVFP4_OP_ARGS, fake_quant_backward, modelopt_dynamic_block_quantize,
                                        override_op_kernels, route_static_nvfp4, save_for_backward_if_needed)

E4M3_MAX = 448.0
# fl32(1/2688) as a Python float: fp32 x this constant rounds once, whatever the backend.
INV_GLOBAL_SCALE = float(torch.tensor(1.0 / (6.0 * E4M3_MAX), dtype=torch.float32))
_GLOBAL_FLOOR = float(torch.tensor(1e-12, dtype=torch.float32))
_SCALE_FLOOR = float(torch.tensor(1e-5, dtype=torch.float32))

# Every finite E4M3 code >= 0 (0x00..0x7E) as fp32.
_E4M3_CODES = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()

# rcp.approx.ftz.f32 of NVIDIA's special function unit. For a mantissa 1.f (f: 23 bits), segment
# i = f >> 16 and x = f & 0xFFFF: rcp(1.f) = S / 2^24 with
#   S = ((c0 << 13) + c1 * x + c2 * sq(2x) + 2023) >> 15,   sq = the unit's truncated squarer,
# and rcp(1.f * 2^k) = rcp(1.f) * 2^-k. The structure is the published quadratic interpolator
# (Oberman & Siu 2005; reverse-engineered by envytools for older GPUs). The coefficients (c0, c1, c2)
# per segment were fitted (linear programming, then the integer range) to the H100's outputs for
# all 2^23 mantissas and reproduce every one of them; benchmarks/nvfp4_gpu_check.py re-checks all
# of them on the GPU (--explore writes the measured table).
_RCP_COEFFS = torch.tensor([
    (67108864, -65534, 1013), (66588642, -64522, 989), (66076422, -63533, 966),
    (65572021, -62567, 945), (65075262, -61622, 923), (64585976, -60699, 902),
    (64103992, -59797, 883), (63629146, -58914, 863), (63161284, -58051, 845),
    (62700254, -57207, 827), (62245905, -56381, 809), (61798091, -55572, 791),
    (61356677, -54781, 774), (60921524, -54007, 758), (60492499, -53249, 742),
    (60069474, -52507, 727), (59652325, -51780, 711), (59240930, -51068, 696),
    (58835170, -50371, 682), (58434930, -49688, 669), (58040099, -49019, 656),
    (57650569, -48363, 642), (57266231, -47721, 631), (56886986, -47091, 618),
    (56512729, -46473, 605), (56143366, -45868, 594), (55778798, -45274, 582),
    (55418934, -44692, 572), (55063686, -44121, 561), (54712961, -43560, 549),
    (54366677, -43011, 540), (54024747, -42471, 529), (53687093, -41942, 519),
    (53353633, -41423, 510), (53024288, -40913, 501), (52698987, -40412, 490),
    (52377651, -39921, 482), (52060212, -39439, 474), (51746596, -38965, 465),
    (51436737, -38500, 457), (51130565, -38043, 449), (50828017, -37594, 441),
    (50529029, -37153, 433), (50233538, -36720, 426), (49941482, -36294, 418),
    (49652803, -35876, 412), (49367442, -35464, 403), (49085342, -35060, 397),
    (48806449, -34663, 390), (48530705, -34272, 383), (48258060, -33888, 377),
    (47988464, -33511, 371), (47721861, -33140, 366), (47458204, -32774, 358),
    (47197444, -32415, 353), (46939534, -32062, 348), (46684429, -31714, 341),
    (46432082, -31373, 337), (46182446, -31036, 331), (45935480, -30705, 326),
    (45691143, -30379, 320), (45449392, -30059, 316), (45210185, -29743, 310),
    (44973481, -29432, 305), (44739244, -29127, 302), (44507436, -28826, 297),
    (44278016, -28529, 291), (44050948, -28237, 287), (43826199, -27950, 283),
    (43603730, -27667, 279), (43383510, -27388, 274), (43165503, -27114, 271),
    (42949675, -26843, 266), (42735995, -26577, 263), (42524430, -26314, 258),
    (42314950, -26056, 256), (42107525, -25801, 251), (41902122, -25550, 248),
    (41698714, -25302, 243), (41497270, -25058, 240), (41297764, -24818, 237),
    (41100168, -24581, 233), (40904453, -24348, 231), (40710593, -24117, 226),
    (40518561, -23890, 223), (40328333, -23667, 222), (40139883, -23446, 218),
    (39953186, -23228, 214), (39768218, -23014, 212), (39584955, -22802, 208),
    (39403371, -22593, 205), (39223448, -22388, 204), (39045159, -22184, 199),
    (38868484, -21984, 197), (38693401, -21787, 196), (38519888, -21592, 193),
    (38347924, -21399, 189), (38177489, -21209, 186), (38008563, -21022, 184),
    (37841123, -20837, 182), (37675154, -20655, 180), (37510633, -20475, 178),
    (37347543, -20297, 175), (37185866, -20122, 173), (37025582, -19949, 171),
    (36866673, -19778, 169), (36709124, -19609, 166), (36552915, -19443, 165),
    (36398030, -19278, 161), (36244452, -19116, 160), (36092164, -18956, 159),
    (35941151, -18797, 155), (35791396, -18641, 154), (35642884, -18487, 153),
    (35495599, -18334, 150), (35349528, -18184, 149), (35204652, -18035, 147),
    (35060959, -17888, 145), (34918436, -17743, 143), (34777064, -17600, 143),
    (34636835, -17458, 140), (34497732, -17318, 138), (34359741, -17180, 137),
    (34222849, -17043, 135), (34087044, -16908, 133), (33952313, -16775, 132),
    (33818641, -16643, 131), (33686019, -16513, 130),
], dtype=torch.int64)


def _truncated_square(v: torch.Tensor) -> torch.Tensor:
    """The SFU's squarer of a 17-bit v: each partial product v * 2^i (bit i of v set) cut below
    2^18 before summing, then halved."""
    acc = torch.zeros_like(v)
    for i in range(17):
        acc += ((v >> i) & 1) * (v >> (18 - i))
    return acc >> 1


def _gpu_rcp(b: torch.Tensor) -> torch.Tensor:
    """rcp.approx.ftz.f32 of fp32 b > 0, bit-exact for normal b (denormal results flush to 0)."""
    bits = b.float().view(torch.int32).long()
    frac = bits & 0x7FFFFF
    c = _RCP_COEFFS.to(b.device)[frac >> 16]
    x = frac & 0xFFFF
    sig = ((c[..., 0] << 13) + c[..., 1] * x + c[..., 2] * _truncated_square(x << 1) + 2023) >> 15
    exp = 253 - ((bits >> 23) & 0xFF) + (sig >> 24)  # sig == 2^24 only for 1/1.0: carry
    out = (exp << 23) | (sig & 0x7FFFFF)
    return torch.where(exp > 0, out, 0).to(torch.int32).view(torch.float32)


def _global_scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.detach().float()
    if amax.numel() != 1:
        amax = amax.amax()
    return amax.reshape(()) * INV_GLOBAL_SCALE


def _tables(
    amax: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor constants: global scale g, rcp(6 g), and per E4M3 code the block scale and its rcp.

    A block scale is one of 127 values per tensor (an E4M3 code times g), so blocks look them up. All but g
    depend on g's value alone and are kept per value (`_scale_tables`): emulating the 128 reciprocals is
    most of a small tensor's quantization, and a calibrated amax stays the same from call to call.
    """
    g = _global_scale(amax).to(device)
    return (g, *_scale_tables(float(g), str(device)))


@functools.lru_cache(maxsize=4096)
def _scale_tables(g: float, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rcp(6 g), and per E4M3 code the block scale and its rcp, for the fp32 global scale g (read only)."""
    g = torch.tensor(g, dtype=torch.float32, device=device)  # the fp32 value it was (float() is exact)
    gsafe = torch.where(g > 0, g, _GLOBAL_FLOOR)
    scale = _E4M3_CODES.to(device) * gsafe
    scale = torch.where(scale >= _SCALE_FLOOR, scale, 1.0)
    return _gpu_rcp(6.0 * gsafe), scale, _gpu_rcp(scale)


def _codes(block_amax: torch.Tensor, rcp6: torch.Tensor) -> torch.Tensor:
    """E4M3 code (int64) of each block's scale: e4m3(min(block_amax / (6 g), 448))."""
    ratio = torch.fmin(block_amax * rcp6, torch.tensor(E4M3_MAX, device=block_amax.device))
    return ratio.to(torch.float8_e4m3fn).view(torch.uint8).long()


def _round_e2m1_(q: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Round q in place to +-E2M1 as the kernel's comparisons do (ties to even), clamped to +-6.

    (q + M) - M with M = 1.5 * 2^(e + 22), e = the exponent of q clamped to [0, 3], rounds q to
    one mantissa bit (steps of 0.5 below 2) in a single IEEE rounding. Zeros come out +0.0, as the
    kernel's fma(-s, q, 0.0) makes them. scratch: int32, q's shape.
    """
    e = torch.bitwise_and(q.view(torch.int32), 0x7F800000, out=scratch)
    e.clamp_(127 << 23, 130 << 23).add_((22 << 23) + 0x400000)
    m = e.view(torch.float32)
    return q.add_(m).sub_(m).clamp_(-6.0, 6.0)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[rows, blocks, block_size] view of x (its dtype); the last dim zero-padded like the kernel's tiles."""
    last = x.shape[-1]
    x2 = x.reshape(-1, last)
    pad = -last % block_size
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.view(x2.shape[0], -1, block_size)


_CHUNK = 1 << 17  # elements per pass: the ~10 passes over a chunk stay in cache


@torch.no_grad()
def nvfp4_fake_quant(x: torch.Tensor, amax: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """NVFP4 quantize-dequantize of x along its last dim; x's dtype and shape. No autograd here:
    ModelOpt's DynamicBlockQuantizationFunction around the op gives the straight-through grad."""
    if x.numel() == 0:
        return x.clone()
    xb = _blocks(x, block_size)
    _, rcp6, scale, rcp = _tables(amax, x.device)
    flat = xb.view(-1, block_size)
    out = torch.empty_like(flat)
    step = max(1, _CHUNK // block_size)
    shape = (min(step, flat.shape[0]), block_size)
    scratch = torch.empty(shape, dtype=torch.int32, device=x.device)
    buf = None if x.dtype == torch.float32 else torch.empty(shape, device=x.device)
    for i in range(0, flat.shape[0], step):
        xc = flat[i : i + step].float()
        n = xc.shape[0]
        q = out[i : i + step] if buf is None else buf[:n]
        code = _codes(torch.abs(xc, out=q).amax(1, keepdim=True), rcp6)
        _round_e2m1_(torch.mul(xc, rcp[code], out=q), scratch[:n]).mul_(scale[code])
        if buf is not None:
            out[i : i + step] = q  # fp32 -> x.dtype, round to nearest even
    return out.view(xb.shape[0], -1)[:, : x.shape[-1]].reshape(x.shape)


@torch.no_grad()
def nvfp4_block_scales(
    x: torch.Tensor, amax: torch.Tensor, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 block scales (shape x.shape[:-1] + (blocks,)) and the fp32 global scale, as the kernel
    computes them: the E4M3 scale times the global scale, 1.0 where that is below 1e-5."""
    g, rcp6, scale, _ = _tables(amax, x.device)
    s = scale[_codes(_blocks(x, block_size).abs().amax(-1).float(), rcp6)]
    return s.reshape(*x.shape[:-1], -1), g


_INV6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))


def static_block_scales(amax: torch.Tensor, global_amax: torch.Tensor | None, fp8_max: float = E4M3_MAX) -> torch.Tensor:
    """ModelOpt's static NVFP4 block scales (``compute_fp4_scales``) as CUDA computes them: s = amax / 6,
    fake-quantized to E4M3 by the FP8 CUDA extension against a = global_amax * (448 / fp8_max) / 6
    (fp8_max 448, or 256 in 4/6 mode). CUDA's tensor / Python-scalar division multiplies by the fp32
    reciprocal; the extension's divisions are IEEE: e = 448 / a, s' = fl32(e4m3(s * e)) * (1 / e),
    the e4m3 cast saturating at +-448, a <= 2^-24 counting as 1."""
    s = amax.float() * _INV6
    if global_amax is None:
        global_amax = amax.float().amax()
    a = global_amax.float().reshape(()) * float(torch.tensor(E4M3_MAX / fp8_max, dtype=torch.float32)) * _INV6
    a = torch.where(a <= 2.0**-24, torch.ones_like(a), a)
    e = torch.full_like(a, E4M3_MAX) / a
    inv = torch.ones_like(e) / e
    return (s * e).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * inv


@torch.no_grad()
def static_nvfp4_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize with given fp32 block scales (one per `x.numel() // scale.numel()`
    consecutive elements), as ModelOpt's ``static_blockwise_fp4_fake_quant_kernel``: |x| / s is
    Triton's div.full.f32 (fl32(|x| * rcp(s))), rounded to E2M1 with ties to even (its comparison
    chain), times s, negated where x < 0 by Triton's unary minus (0 - y: zeros come out +0.0); a zero
    scale gives +0.0, a NaN/inf scale counts as 1.0; the result is cast to x's dtype."""
    blocks = scale.numel()
    xb = x.contiguous().view(blocks, -1).float()
    s = scale.reshape(blocks, 1).float()
    safe = torch.where((s == 0) | s.isnan() | s.isinf(), 1.0, s)
    q = xb.abs() * _gpu_rcp(safe)
    _round_e2m1_(q, torch.empty_like(q, dtype=torch.int32)).mul_(safe)
    out = torch.where(xb >= 0, q, 0.0 - q)
    return torch.where(s == 0, 0.0, out).to(x.dtype).view(x.shape)


class _StaticNVFP4(torch.autograd.Function):
    """ModelOpt's StaticBlockwiseFP4FakeQuantFunction on CPU tensors: the same arguments, its
    straight-through backward (clipped where |x| > amax unless pass_through_bwd)."""

    @staticmethod
    def forward(ctx, x, amax, global_amax=None, quantize_block_scales=True, fp8_max=E4M3_MAX, out_dtype=None,
                pass_through_bwd=False):
        if not quantize_block_scales:
            raise NotImplementedError("static NVFP4 on CPU: block scales are always E4M3 in the shipped formats")
        save_for_backward_if_needed(ctx, pass_through_bwd, x, amax)
        out = static_nvfp4_fake_quant(x, static_block_scales(amax, global_amax, fp8_max))
        return out if out_dtype is None else out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        return fake_quant_backward(ctx, grad, num_args=7)


_LIB: torch.library.Library | None = None


def install() -> None:
    """Run ModelOpt's NVFP4 op on CPU tensors through nvfp4_fake_quant (idempotent).

    Replaces the CPU kernel of ModelOpt's block fake-quant op (`modelopt_compat.override_op_kernels`); other
    formats still go to ModelOpt's implementation, CUDA is untouched. Static-scale NVFP4 (ModelOpt's MSE /
    4-over-6 weight formats) of CPU tensors goes to `_StaticNVFP4`.
    """
    global _LIB
    if _LIB is not None:
        return

    def cpu_kernel(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        args = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        if args != NVFP4_OP_ARGS:
            return modelopt_dynamic_block_quantize(inputs, block_size, amax, *args)
        if block_size != 16:
            # ModelOpt's Triton kernel ignores block_size (always 16): no GPU behaviour to match.
            raise NotImplementedError(f"NVFP4 on CPU supports block_size 16 only, got {block_size}")
        return nvfp4_fake_quant(inputs, amax)

    _LIB = override_op_kernels("CPU", dynamic_block_quantize=cpu_kernel)
    route_static_nvfp4(_StaticNVFP4.apply)
