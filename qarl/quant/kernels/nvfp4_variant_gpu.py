"""The NVFP4 input variants of `qarl.quant.input_variants` (per-token scales, 4-over-6 block scales, Hadamard-rotated
blocks) as one Triton kernel: the GPU implementation of the op `qarl::nvfp4_input_variant`.

The torch implementation there is a chain of small kernels per call (two hundred layers' inputs a decode step, each
dozens of launches); this one is one launch. It computes the contract of `input_variants` operation for operation, so
it changes no bit of it (`tests/integration/test_gpu_kernels.py` checks it in Triton's interpreter on CPU and against
the torch implementation on a GPU):

- fp32 throughout; divisions correctly rounded (`tl.math.div_rn`, not Triton's approximate `/`), and no multiply-add
  fused (`enable_fp_fusion=False`), as torch computes each operation on its own;
- a block's squared error summed in index order: element i taken out of its block exactly (a sum of it and fifteen
  zeros) and added to the running total;
- the Hadamard's butterflies as the torch version stacks them: element i of a pair group of 2h gets `x[i] + x[i + h]`
  below h, `x[i - h] - x[i]` from h on, four stages, then x 1/4;
- E2M1 values and E4M3 block scales rounded to nearest, ties to the even code, by fp32 arithmetic (`to_grid`), as the
  torch version's search and cast find them; not by Triton's cast to float8, which Triton's interpreter rounds wrongly
  where a value rounds up to the next power of two (31 to 16, not 32);
- a NaN kept through every max and min, as torch's `amax` and `clamp` keep it (Triton's drop it by default);
- a negative input's value negated by its sign bit (torch's `-q`, which gives -0 for 0; Triton's unary minus was
  `0 - q` up to 3.6).

One program a row (a token): with per-token scales it reads its row twice, for the max and then to quantize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCKS_PER_ITERATION = 16  # 16-element blocks a program handles at a time: 256 elements
NUM_WARPS = 2


@triton.jit
def nan_max(a, b):
    """max that keeps a NaN, as torch's amax does (Triton's max drops it by default)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def butterfly(x, HALF: tl.constexpr, BLOCKS: tl.constexpr):
    """One stage of the Walsh-Hadamard transform of each row of x [BLOCKS, 16]: pairs HALF apart."""
    y = tl.permute(tl.reshape(x, (BLOCKS, 16 // (2 * HALF), 2, HALF)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (BLOCKS, 16))


@triton.jit
def hadamard(x, BLOCKS: tl.constexpr):
    x = butterfly(x, 1, BLOCKS)
    x = butterfly(x, 2, BLOCKS)
    x = butterfly(x, 4, BLOCKS)
    x = butterfly(x, 8, BLOCKS)
    return x * 0.25


@triton.jit
def to_grid(v, MIN_EXPONENT: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """v >= 0 to the nearest value of a small float format (E4M3: -6, 3; E2M1: 0, 1) at or below its largest, ties to
    even, by arithmetic: with e v's exponent (at least the format's smallest normal one), v + 2^(e - bits + 23) rounds
    v to a multiple of the format's step 2^(e - bits) there, as fp32 addition rounds, and subtracting it again is
    exact."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127, MIN_EXPONENT)
    magic = ((exponent + (150 - MANTISSA_BITS)) << 23).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def mapped(magnitude, g, TOP: tl.constexpr):
    """NVFP4 quantize-dequantize of magnitude [BLOCKS, 16] with each block's max mapped to TOP."""
    scale = tl.math.div_rn(tl.reduce(magnitude, 1, nan_max, keep_dims=True), g * TOP)
    scale = tl.minimum(scale, 448.0, propagate_nan=tl.PropagateNan.ALL)  # E4M3's largest value
    scale = to_grid(scale, -6, 3) * g  # E4M3
    scale = tl.where(scale == 0.0, 1.0, scale)
    r = tl.minimum(tl.math.div_rn(magnitude, scale), 6.0, propagate_nan=tl.PropagateNan.ALL)  # E2M1's largest
    return to_grid(r, 0, 1) * scale  # E2M1


@triton.jit
def squared_error(a, b, lane):
    """Each row's sum of (a - b)^2 [BLOCKS, 1], added in index order."""
    d = (a - b) * (a - b)
    total = tl.sum(tl.where(lane == 0, d, 0.0), axis=1, keep_dims=True)
    for i in tl.static_range(1, 16):
        total = total + tl.sum(tl.where(lane == i, d, 0.0), axis=1, keep_dims=True)
    return total

@triton.jit
def load_blocks(x_ptr, row_start, first_block, blocks_per_row, n_cols, BLOCKS: tl.constexpr,
                HADAMARD: tl.constexpr):
    """BLOCKS blocks of a row from `first_block` on, fp32, zero-padded, rotated if HADAMARD; and their offsets
    and mask."""
    blk = first_block + tl.arange(0, BLOCKS)
    col = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = (blk < blocks_per_row)[:, None] & (col < n_cols)
    x = tl.load(x_ptr + row_start + col, mask=mask, other=0.0).to(tl.float32)
    if HADAMARD:
        x = hadamard(x, BLOCKS)
    return x, col, mask

@triton.jit
def variant_kernel(x_ptr, y_ptr, amax_ptr, n_cols, blocks_per_row, PER_TOKEN: tl.constexpr,
                   FOUR_OVER_SIX: tl.constexpr, HADAMARD: tl.constexpr, BLOCKS: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * n_cols
    lane = tl.arange(0, 16)[None, :]
    if PER_TOKEN:
        running = tl.zeros((BLOCKS, 16), tl.float32)
        for first in range(0, blocks_per_row, BLOCKS):
            x, col, mask = load_blocks(x_ptr, row_start, first, blocks_per_row, n_cols, BLOCKS, HADAMARD)
            running = nan_max(running, tl.abs(x))
        row_max = tl.reduce(tl.reduce(running, 1, nan_max), 0, nan_max)
    else:
        row_max = tl.load(amax_ptr).to(tl.float32)
    g = row_max * 0.00037202381645329297  # exactly fl32(1/2688), input_variants' INV_GLOBAL_SCALE
    g = tl.where(g > 0.0, g, 1e-12)
    for first in range(0, blocks_per_row, BLOCKS):
        x, col, mask = load_blocks(x_ptr, row_start, first, blocks_per_row, n_cols, BLOCKS, HADAMARD)
        magnitude = tl.abs(x)
        q = mapped(magnitude, g, 6.0)
        if FOUR_OVER_SIX:
            four = mapped(magnitude, g, 4.0)
            better = squared_error(four, magnitude, lane) < squared_error(q, magnitude, lane)
            q = tl.where(better, four, q)
        negated = (q.to(tl.int32, bitcast=True) | -2147483648).to(tl.float32, bitcast=True)
        y = tl.where(x < 0.0, negated, q)
        if HADAMARD:
            y = hadamard(y, BLOCKS)
        tl.store(y_ptr + row_start + col, y, mask=mask)


def fake_quant(x: torch.Tensor, amax: torch.Tensor, per_token: bool, four_over_six: bool,
               hadamard: bool) -> torch.Tensor:
    """`input_variants`' fake quantization of a contiguous x (fp32, bf16 or fp16; CUDA, or CPU under
    TRITON_INTERPRET=1) along its last dim: one kernel launch into fp32, then torch's cast to x's dtype (the torch
    implementation's own last step, rounding to nearest even, which Triton's interpreter would truncate)."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y.to(x.dtype)
    n_cols = x.shape[-1]
    amax = amax.detach().float().reshape(1).to(x.device)
    variant_kernel[(x.numel() // n_cols,)](x, y, amax, n_cols, -(-n_cols // 16), PER_TOKEN=per_token,
                                           FOUR_OVER_SIX=four_over_six, HADAMARD=hadamard,
                                           BLOCKS=BLOCKS_PER_ITERATION, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return y.to(x.dtype)
