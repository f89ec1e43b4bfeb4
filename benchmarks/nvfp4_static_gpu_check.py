"""Bit-for-bit check of qarl's CPU port of ModelOpt's *static* NVFP4 fake quant against the GPU kernel.

The static kernel (``static_blockwise_fp4_fake_quant``: calibrated per-block amax, used by ModelOpt's
MSE-calibrated and 4-over-6 NVFP4 formats) runs only through Triton on CUDA; qarl runs it on CPU with
``qarl.quant.kernels.nvfp4_cpu._StaticNVFP4`` (installed into ModelOpt's TensorQuantizer by ``install()``).
Needs a CUDA GPU and nvidia-modelopt:

    python benchmarks/nvfp4_static_gpu_check.py --out benchmarks/results/nvfp4_static_gpu_check.md

Cases: Gaussian and heavy-tailed inputs, per-block amax below and above the block max (clipping),
all-zero blocks, inputs placed exactly on E2M1 midpoints of their block scale, fp32 / bf16 / fp16, the
normal (E4M3 max 448) and 4-over-6 (256) scale normalisation, with and without a given global amax.
Outputs are compared on their raw bits; the block scales too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from nvfp4_gpu_check import DTYPES, INT_VIEW, MIDPOINTS, load_nvfp4_cpu  # the dynamic kernel's check, beside


def cases(gen: torch.Generator, rows: int, cols: int):
    """(name, x fp32 [rows, cols], per-block amax [rows, cols // 16]) on the CPU."""
    blocks = lambda x: x.view(rows, cols // 16, 16)  # noqa: E731
    gauss = torch.randn(rows, cols, generator=gen)
    heavy = torch.randn(rows, cols, generator=gen) ** 3
    for name, x in (("gaussian", gauss), ("heavy", heavy)):
        bmax = blocks(x).abs().amax(-1)
        yield f"{name}/amax=max", x, bmax
        yield f"{name}/amax~U(0.6,1.1)max", x, bmax * (0.6 + 0.5 * torch.rand(bmax.shape, generator=gen))
    zeros = gauss.clone()
    blocks(zeros)[:, ::3] = 0.0
    yield "zero blocks", zeros, blocks(zeros).abs().amax(-1)
    # exact midpoints t * s of each block's (pre-E4M3) scale s = amax / 6, random signs
    amax = blocks(gauss).abs().amax(-1)
    midpoints = torch.tensor(MIDPOINTS)
    pick = torch.randint(0, len(midpoints), (rows, cols), generator=gen)
    sign = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    ties = sign * midpoints[pick] * (amax / 6.0).repeat_interleave(16, dim=1)
    yield "midpoints of amax/6", ties, amax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="nvfp4_static_gpu_check.md")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import modelopt
    import triton
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel import compute_fp4_scales
    from modelopt.torch.quantization.tensor_quant import static_blockwise_fp4_fake_quant

    cpu = load_nvfp4_cpu()
    gen = torch.Generator().manual_seed(args.seed)
    lines, total, bad, scale_bad, n_cases = [], 0, 0, 0, 0
    start = time.perf_counter()
    for rows, cols in ((64, 256), (896, 4864)):
        for case, x32, amax in cases(gen, rows, cols):
            for dname, dtype in DTYPES.items():
                x = x32.to(dtype)
                for fp8_max in (448.0, 256.0):
                    for with_global in (True, False):
                        g = amax.max() if with_global else None
                        ref = static_blockwise_fp4_fake_quant(x.cuda(), amax.cuda(), None if g is None else g.cuda(),
                                                              True, fp8_max, dtype, False).cpu()
                        got = cpu._StaticNVFP4.apply(x, amax, g, True, fp8_max, dtype, False)
                        mismatch = ref.view(INT_VIEW[dtype]) != got.view(INT_VIEW[dtype])
                        differ = int(mismatch.sum())
                        zero_signs = int((mismatch & (ref == 0) & (got == 0)).sum())
                        s_ref = compute_fp4_scales(amax.cuda(), None if g is None else g.cuda(), True, fp8_max).cpu()
                        s_got = cpu.static_block_scales(amax, g, fp8_max)
                        s_differ = int((s_ref.view(torch.int32) != s_got.view(torch.int32)).sum())
                        total += x.numel()
                        bad += differ
                        scale_bad += s_differ
                        n_cases += 1
                        if differ or s_differ:
                            lines.append(f"| {rows}x{cols} | {case} | {dname} | {fp8_max:.0f} | {with_global} | "
                                         f"{differ} ({zero_signs} signs of zero) | {s_differ} |")
    report = [
        "# Static NVFP4 fake quant: qarl CPU port vs ModelOpt's Triton kernel, bit for bit", "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; modelopt {modelopt.__version__}; "
        f"triton {triton.__version__}; `python benchmarks/nvfp4_static_gpu_check.py --seed {args.seed}`",
        f"- {n_cases} cases, {total} elements in {time.perf_counter() - start:.0f} s: **{bad} output elements and "
        f"{scale_bad} block scales differ**.",
        "- reference: `modelopt.torch.quantization.tensor_quant.static_blockwise_fp4_fake_quant` on CUDA; "
        "qarl: `qarl.quant.kernels.nvfp4_cpu._StaticNVFP4` on CPU (what ModelOpt's TensorQuantizer calls there after "
        "`install()`); scales: ModelOpt's `compute_fp4_scales` on CUDA vs `static_block_scales` on CPU.",
    ]
    if lines:
        report += ["", "| shape | case | dtype | fp8 max | global amax given | outputs differ | scales differ |",
                   "|---|---|---|---|---|---|---|", *lines]
    Path(args.out).write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
