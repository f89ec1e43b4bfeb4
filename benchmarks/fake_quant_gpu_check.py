"""qarl's GPU fake-quant kernels (qarl/quant/kernels/gpu.py) against ModelOpt's own GPU paths: bits and time.

    python benchmarks/fake_quant_gpu_check.py [--out FILE.md] [--seed 0] [--tune]

Needs a CUDA GPU of compute capability >= 8.9, triton and nvidia-modelopt 0.47. The references are
ModelOpt's implementations called directly, so qarl's install() cannot reach them:

- NVFP4: ``tensor_quant._dynamic_block_quantize_impl(x, 16, amax, 4, 2, 8, 4)``, i.e. the Triton
  kernel ``fp4_fake_quant_block`` (what the CUDA kernel of ``tensorrt::dynamic_block_quantize_op`` runs).
- FP8: ``tensor_quant._quantize_impl(x, amax, 8, 4, False, False)``, i.e. ``scaled_e4m3_impl``: the
  CUDA extension ``fake_e4m3fy`` (or ``fp8_eager`` where the extension cannot be built; the report
  says which). ``fp8_eager`` on CUDA is also compared with ``fp8_fake_quant_cuda(..., eager=True)``.

Columns count elements whose raw bits differ from the reference (``(±0: k)``: k of them differ only
in the sign of zero). ``kernel``: qarl's launcher; ``op``: ModelOpt's torch.library op after
``install()``; ``cpu port``: ``nvfp4_cpu.nvfp4_fake_quant`` on the same data on the CPU. Timings, two ways:

- one call, L2 flushed: ``triton.testing.do_bench`` medians (GPU time). Its flush zeroes 256 MB before
  each call, which leaves the L2 full of dirty lines for the timed call to write back as it evicts them.
  ``read flush``: the same call after a flush that reads 256 MB instead (clean lines), the control.
- back to back: one call per tensor over several distinct tensors that together are 4x the L2, queued
  behind a sleep kernel so that the GPU never waits for the host, outputs kept (GPU time per call,
  median of rounds). Each call reads its input from memory and writes its own output only, as when the
  weights are quantized one after another (the GPU side of it: host time is the ``op wall`` column).

``clone``: ``x.clone()``, the same bytes read and written and the output allocated alike, timed the same
way (the memory floor of a quantize-dequantize). ``op wall``: host time per call of the op, back to back
on one tensor (what a training step pays, launch overheads included). ``--tune`` also times other block
and warp counts. Exit status 1 if any bit differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BENCH_SHAPES = {"weight 4864x896": (4864, 896), "act 8x512x896": (8, 512, 896), "weight 896x4864": (896, 4864)}
NVFP4_OP_ARGS = (4, 2, 8, 4)
DEVICE = "cuda"


def load(name: str, rel: str):
    """Load a qarl module by path: the rest of qarl (vLLM, ...) is not needed here."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- cases
Case = tuple[str, str, torch.Tensor, torch.Tensor]  # name, amax mode, x, amax (device tensors)


def with_amax_modes(name: str, x: torch.Tensor) -> Iterator[Case]:
    top = x.float().abs().amax()
    for mode, f in (("max", 1.0), ("max/2", 0.5), ("2max", 2.0)):
        yield name, mode, x, top * f


def common_data(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 data shared by both formats (fp16-safe magnitudes)."""

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    def student_t(*shape, df):
        chi2 = torch._standard_gamma(torch.full(shape, df / 2, device=DEVICE), generator=gen) * 2
        return randn(*shape) / torch.sqrt(chi2 / df)

    data = {
        "normal": randn(256, 1024),
        "weight_0.02": randn(512, 896) * 0.02,
        "student_t3": student_t(256, 1024, df=3.0),
        "student_t1.5": student_t(128, 1024, df=1.5).clamp(-6e4, 6e4),
        "row_scaled": randn(256, 1024) * 10.0 ** (torch.rand(256, 1, device=DEVICE, generator=gen) * 6 - 3),
    }
    x = randn(256, 1024)
    x[torch.rand(256, device=DEVICE, generator=gen) < 0.03] *= 300.0
    data["outlier_rows"] = x
    x = randn(4, 64, 896) * 2
    x[..., torch.randint(0, 896, (6,), device=DEVICE, generator=gen)] *= 50.0
    data["act3d_outlier_channels"] = x
    x = randn(256, 1024).view(256, 64, 16)
    x[torch.rand(256, 64, device=DEVICE, generator=gen) < 0.3] = 0
    data["zero_blocks"] = x.view(256, 1024)
    x = randn(256, 1024).view(256, 64, 16)
    tiny = torch.rand(256, 64, device=DEVICE, generator=gen) < 0.3
    x[tiny] *= 10.0 ** torch.randint(-9, -4, (int(tiny.sum()), 1), device=DEVICE, generator=gen).float()
    data["tiny_blocks"] = x.view(256, 1024)
    k = torch.randint(0, 12, (256, 1024), device=DEVICE, generator=gen).float()
    data["pow2_grid"] = torch.where(torch.rand(256, 1024, device=DEVICE, generator=gen) < 0.5, -1.0, 1.0) * 0.5**k
    data["int_grid"] = torch.randint(-64, 65, (256, 1024), device=DEVICE, generator=gen) / 64.0
    data["ragged_33x100"] = randn(33, 100)
    data["ragged_7x13"] = randn(7, 13)
    data["ragged_5x3x40"] = randn(5, 3, 40)
    data["vector_1000"] = randn(1000)
    return data


def nvfp4_midpoints(nv, gen: torch.Generator, dtype: torch.dtype) -> Iterator[Case]:
    """Elements 1..15 of each block at t * s (t an E2M1 midpoint, s the block's scale), +-0 or 2 ulps."""
    for label, top in (("exact", 336.0), ("random_amax", float(torch.rand((), device=DEVICE, generator=gen)) * 99 + 1)):
        top = float(torch.tensor(top).to(dtype))  # exact: |x| / s hits the midpoints in every dtype
        bmax = ((torch.rand(256, 64, 1, device=DEVICE, generator=gen) * 0.99 + 0.01) * top).to(dtype).float()
        bmax[0, 0] = top
        for mode, f in (("max", 1.0), ("max/2", 0.5), ("2max", 2.0)):
            amax = torch.tensor(top * f, device=DEVICE)
            s, _ = nv.nvfp4_block_scales(bmax.expand(256, 64, 16).reshape(256, 1024).cpu(), amax.cpu())
            t = torch.tensor(E2M1_MIDPOINTS, device=DEVICE)[
                torch.randint(0, 7, (256, 64, 15), device=DEVICE, generator=gen)]
            v = (t * s.to(DEVICE).unsqueeze(-1)).to(dtype)
            for ulps in (0, 2):
                if ulps:
                    step = torch.randint(-ulps, ulps + 1, v.shape, device=DEVICE, generator=gen)
                    v = (v.view(INT_VIEW[dtype]) + step.to(INT_VIEW[dtype])).view(dtype)
                sign = torch.where(torch.rand(256, 64, 16, device=DEVICE, generator=gen) < 0.5, -1.0, 1.0)
                x = torch.cat([bmax, v.float()], dim=-1) * sign
                yield f"midpoints_{label}_pm{ulps}ulp", mode, x.view(256, 1024).to(dtype), amax


def nvfp4_cases(nv, gen: torch.Generator, dtype: torch.dtype) -> Iterator[Case]:
    for name, x in common_data(gen).items():
        yield from with_amax_modes(name, x.to(dtype))
    yield from nvfp4_midpoints(nv, gen, dtype)
    yield "all_zero", "0", torch.zeros(64, 256, device=DEVICE, dtype=dtype), torch.zeros((), device=DEVICE)


def fp8_cases(gen: torch.Generator, dtype: torch.dtype) -> Iterator[Case]:
    for name, x in common_data(gen).items():
        yield from with_amax_modes(name, x.to(dtype))
    # E4M3 midpoints: scale = 448 / amax = 1 exactly, x halfway between neighbouring codes (+-1 ulp)
    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(DEVICE)
    mids = (codes[:-1] + codes[1:]) / 2
    x = mids[torch.randint(0, len(mids), (256, 1024), device=DEVICE, generator=gen)].to(dtype)
    x = x * torch.where(torch.rand(256, 1024, device=DEVICE, generator=gen) < 0.5, -1.0, 1.0).to(dtype)
    for ulps in (0, 1):
        step = torch.randint(-ulps, ulps + 1, x.shape, device=DEVICE, generator=gen).to(INT_VIEW[dtype])
        yield f"e4m3_midpoints_pm{ulps}ulp", "448", (x.view(INT_VIEW[dtype]) + step).view(dtype), \
            torch.tensor(448.0, device=DEVICE)
    x = torch.randn(256, 1024, device=DEVICE, generator=gen).to(dtype)
    for label, a in (("0", 0.0), ("2^-25", 2.0**-25), ("1e-3", 1e-3), ("1e4", 1e4)):
        yield "fixed_amax", label, x, torch.tensor(a, device=DEVICE)
    yield "all_zero", "0", torch.zeros(64, 256, device=DEVICE, dtype=dtype), torch.zeros((), device=DEVICE)


# ---------------------------------------------------------------- comparison
def differ(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(elements whose bits differ, of those: equal values, i.e. +0 vs -0)."""
    a, b = a.contiguous(), b.to(a.device).contiguous()
    mask = a.view(INT_VIEW[a.dtype]) != b.view(INT_VIEW[b.dtype])
    return int(mask.sum()), int((mask & (a == b)).sum())


def cell(d: tuple[int, int]) -> str:
    return f"{d[0]} (±0: {d[1]})" if d[1] else str(d[0])


def run_checks(gk, nv, tq, gen: torch.Generator, fp8_ext: bool) -> tuple[list[str], int]:
    """Per format and dtype: cases, elements and differing elements per column; then the cases that differ."""
    block_op, quant_op = torch.ops.tensorrt.dynamic_block_quantize_op, torch.ops.tensorrt.quantize_op
    formats: dict[str, tuple[Callable, dict[str, Callable]]] = {
        "NVFP4": (
            lambda x, a: tq._dynamic_block_quantize_impl(x, 16, a, *NVFP4_OP_ARGS),
            {
                "kernel": gk.nvfp4_fake_quant_cuda,
                "op": lambda x, a: block_op(x, 16, a, *NVFP4_OP_ARGS),
                "cpu port": lambda x, a: nv.nvfp4_fake_quant(x.cpu(), a.cpu()),
            },
        ),
        "FP8": (
            lambda x, a: tq._quantize_impl(x, a, 8, 4, False, False),
            {
                "kernel": lambda x, a: gk.fp8_fake_quant_cuda(x, a, eager=not fp8_ext),
                "op": lambda x, a: quant_op(x, a, 8, 4, False, False),
            },
        ),
        "FP8 eager": (tq.fp8_eager, {"kernel": lambda x, a: gk.fp8_fake_quant_cuda(x, a, eager=True)}),
    }
    summary = ["| format | dtype | cases | elements | columns: differing elements |", "|---|---|---|---|---|"]
    details = []
    bad = 0
    for fmt, (ref_fn, cols) in formats.items():
        for dname, dtype in DTYPES.items():
            cases = nvfp4_cases(nv, gen, dtype) if fmt == "NVFP4" else fp8_cases(gen, dtype)
            n_cases = n_el = 0
            totals = {c: [0, 0] for c in cols}
            for name, mode, x, amax in cases:
                ref = ref_fn(x, amax)
                diffs = {c: differ(ref, fn(x, amax)) for c, fn in cols.items()}
                n_cases += 1
                n_el += x.numel()
                for c, d in diffs.items():
                    totals[c][0] += d[0]
                    totals[c][1] += d[1]
                if any(d[0] for d in diffs.values()):
                    details.append(f"| {fmt} | {name} | {dname} | {mode} | {'x'.join(map(str, x.shape))} | "
                                   + ", ".join(f"{c}: {cell(d)}" for c, d in diffs.items()) + " |")
            bad += sum(t[0] for t in totals.values())
            summary.append(f"| {fmt} | {dname} | {n_cases} | {n_el} | "
                           + ", ".join(f"{c}: {cell(tuple(t))}" for c, t in totals.items()) + " |")
    lines = ["## Bit identity", "", *summary]
    if details:
        lines += ["", "### Cases with differences", "", "| format | case | dtype | amax | shape | differing |",
                  "|---|---|---|---|---|---|", *details]
    return lines, bad


# ---------------------------------------------------------------- timing
def wall_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time per call, calls back to back (median of 5 rounds)."""
    fn()
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(rounds)[2]


def flushed_us(fn: Callable[[], object], rep: int = 200) -> float:
    """GPU time of one call with the L2 flushed before it (do_bench median)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def read_flushed_us(fn: Callable[[], object], reps: int = 100) -> float:
    """GPU time of one call after a flush that reads 256 MB (median): do_bench's timing with clean lines in
    the L2 instead of the dirty ones its zeroing flush leaves."""
    flush = torch.ones(64 << 20, dtype=torch.int32, device=DEVICE)
    total = torch.empty((), dtype=torch.int64, device=DEVICE)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    fn()
    for start, end in events:
        torch.sum(flush, dim=0, dtype=torch.int64, out=total)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


Pair = tuple[torch.Tensor, torch.Tensor]  # x, amax


def clone(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The memory floor of a quantize-dequantize of x: the same bytes read and written, the output allocated
    alike (amax unused: the kernels' signature)."""
    return x.clone()


def cold_tensors(shape: tuple[int, ...], gen: torch.Generator) -> list[Pair]:
    """Distinct bf16 tensors of `shape` (with their amax), together 4x the L2: cold for back_to_back_us."""
    l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size
    n = max(8, -(-4 * l2 // (torch.Size(shape).numel() * 2)))
    xs = [torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(n)]
    return [(x, x.float().abs().amax()) for x in xs]


def back_to_back_us(fn: Callable[[torch.Tensor, torch.Tensor], object], pairs: list[Pair], rounds: int = 15) -> float:
    """GPU time per call of `fn(x, amax)`, one call per pair launched back to back (median of rounds).

    The calls are queued behind a sleep kernel; a round counts only if the host had queued all of them
    before the sleep ended (the start event had not run), so no call waited for its launch, and the sleep
    is doubled until that holds. The outputs are kept until the round ends, so each call writes fresh memory.
    """
    warm = [fn(x, a) for x, a in pairs]  # compiles, and leaves a round's outputs in the allocator's cache
    warm.clear()
    times: list[float] = []
    cycles = 1 << 20
    while len(times) < rounds:
        if cycles > 1 << 34:  # ~10 s of sleep: fn waits for the GPU (a host synchronisation)
            raise RuntimeError("back_to_back_us: the calls could not be queued ahead of the GPU; does fn synchronize?")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start.record()
        outs = [fn(x, a) for x, a in pairs]
        end.record()
        queued_in_time = not start.query()
        end.synchronize()
        outs.clear()  # the outputs lived until the round ended
        if queued_in_time:
            times.append(start.elapsed_time(end) * 1e3 / len(pairs))
        else:
            cycles *= 2
    return statistics.median(times)


def run_timing(gk, tq, gen: torch.Generator) -> list[str]:
    block_op, quant_op = torch.ops.tensorrt.dynamic_block_quantize_op, torch.ops.tensorrt.quantize_op
    kernels = {
        "NVFP4": (lambda x, a: tq._dynamic_block_quantize_impl(x, 16, a, *NVFP4_OP_ARGS), gk.nvfp4_fake_quant_cuda,
                  lambda x, a: block_op(x, 16, a, *NVFP4_OP_ARGS)),
        "FP8": (lambda x, a: tq._quantize_impl(x, a, 8, 4, False, False), gk.fp8_fake_quant_cuda,
                lambda x, a: quant_op(x, a, 8, 4, False, False)),
    }
    flushed = ["### One call, L2 flushed (do_bench; read flush: the control)", "",
               "| tensor | format | ModelOpt kernel | qarl kernel | speedup | clone | qarl / clone | qarl, read flush "
               "| clone, read flush | ModelOpt op wall | qarl op wall |", "|---" * 11 + "|"]
    b2b = ["### Back to back over cold tensors", "",
           "| tensor | tensors | format | ModelOpt kernel | qarl kernel | speedup | clone | qarl / clone |",
           "|---|---|---|---|---|---|---|---|"]
    for label, shape in BENCH_SHAPES.items():
        pairs = cold_tensors(shape, gen)
        x, amax = pairs[0]
        t_clone, r_clone = flushed_us(partial(clone, x, amax)), read_flushed_us(partial(clone, x, amax))
        c_clone = back_to_back_us(clone, pairs)
        for fmt, (ref, ours, op) in kernels.items():
            t_ref, t_ours = flushed_us(partial(ref, x, amax)), flushed_us(partial(ours, x, amax))
            r_ours = read_flushed_us(partial(ours, x, amax))
            c_ref, c_ours = back_to_back_us(ref, pairs), back_to_back_us(ours, pairs)
            with gk.modelopt_kernels():
                w_ref = wall_us(partial(op, x, amax))
            w_ours = wall_us(partial(op, x, amax))
            flushed.append(f"| {label} | {fmt} | {t_ref:.1f} | {t_ours:.1f} | {t_ref / t_ours:.1f}x | {t_clone:.1f} | "
                           f"{t_ours / t_clone:.2f} | {r_ours:.1f} | {r_clone:.1f} | {w_ref:.1f} | {w_ours:.1f} |")
            b2b.append(f"| {label} | {len(pairs)} | {fmt} | {c_ref:.1f} | {c_ours:.1f} | {c_ref / c_ours:.1f}x | "
                       f"{c_clone:.1f} | {c_ours / c_clone:.2f} |")
        del pairs, x, amax
    return ["## Timing (bf16, GPU us a call)", "", *flushed, "", *b2b]


def run_tune(gk, gen: torch.Generator, rounds: int = 9) -> list[str]:
    """Other block and warp counts, timed both ways in interleaved rounds (every configuration once a round,
    and a clone, in an order rotated from round to round), each against the clone of its round: per tensor,
    median us (flushed / back to back) and the median ratio to the clone."""
    configs: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {"clone": clone}
    for n in (32, 64, 128, 256):
        for w in (2, 4, 8):
            configs[f"NVFP4 | {n} blocks | {w}"] = partial(gk.nvfp4_fake_quant_cuda, blocks_per_program=n, num_warps=w)
    for n in (1024, 2048, 4096, 8192):
        for w in (2, 4, 8):
            configs[f"FP8 | {n} elements | {w}"] = partial(gk.fp8_fake_quant_cuda, block=n, num_warps=w)
    cells: dict[str, list[str]] = {name: [] for name in configs}
    for shape in BENCH_SHAPES.values():
        pairs = cold_tensors(shape, gen)
        times = {name: ([], []) for name in configs}  # flushed, back to back
        names = list(configs)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn = configs[name]
                times[name][0].append(flushed_us(partial(fn, *pairs[r % len(pairs)]), rep=50))
                times[name][1].append(back_to_back_us(fn, pairs, rounds=5))
        clone_times = times["clone"]
        for name, (flushed, b2b) in times.items():
            ratios = [statistics.median(t / c for t, c in zip(mine, ref))
                      for mine, ref in ((flushed, clone_times[0]), (b2b, clone_times[1]))]
            cells[name].append(f"{statistics.median(flushed):.1f} / {statistics.median(b2b):.1f} "
                               f"({ratios[0]:.2f} / {ratios[1]:.2f})")
    lines = [f"## Tuning (bf16; us one call L2 flushed / back to back, median of {rounds} interleaved rounds; "
             "in brackets: median ratio to the clone of the same round)", "",
             "| format | per program | warps | " + " | ".join(BENCH_SHAPES) + " |",
             "|---|---|---|" + "---|" * len(BENCH_SHAPES)]
    for name, row in cells.items():
        label = "clone |  | " if name == "clone" else name
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def ptx_ops(gk) -> list[str]:
    """The PTX opcodes that decide the numerics, of qarl's kernels and of ModelOpt's NVFP4 kernel."""
    pattern = re.compile(r"^\s*((?:div|rcp|cvt|min|max|neg|sub|fma)\.[\w.]+)", re.M)
    nvfp4, fp8 = gk._kernels()
    x = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    y, amax = torch.empty_like(x), torch.ones((), device=DEVICE)
    try:  # a launch returns the compiled kernel (Triton 3.x); diagnostics only
        kernels = {
            "qarl NVFP4": nvfp4[(1,)](x, y, amax, 64, 4, 64, BLOCKS=gk.NVFP4_BLOCKS_PER_PROGRAM, EVEN=True,
                                      num_warps=gk.NVFP4_NUM_WARPS).asm["ptx"],
            "qarl FP8": fp8[(1,)](x, y, amax, x.numel(), BLOCK=gk.FP8_BLOCK, EAGER=False,
                                  num_warps=gk.FP8_NUM_WARPS).asm["ptx"],
        }
    except Exception as e:  # noqa: BLE001
        return [f"- PTX of qarl's kernels not available: {e!r}"]
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache"))
    for p in sorted(cache.rglob("fp4_fake_quant_kernel.ptx"))[:1]:
        kernels["ModelOpt NVFP4 (from the Triton cache)"] = p.read_text()
    return [f"- {name} PTX: " + ", ".join(sorted(set(pattern.findall(ptx)))) for name, ptx in kernels.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fake_quant_gpu_check.md", help="markdown report path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tune", action="store_true", help="also time other block / warp counts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (compute capability >= 8.9), triton and nvidia-modelopt")

    import modelopt
    import modelopt.torch.kernels.quantization.gemm as modelopt_triton
    import triton
    from modelopt.torch.quantization import tensor_quant as tq

    gk = load("qarl_gpu_kernels", "qarl/quant/kernels/gpu.py")
    nv = load("qarl_nvfp4_cpu", "qarl/quant/kernels/nvfp4_cpu.py")
    if not (gk.available() and hasattr(modelopt_triton, "fp4_fake_quant_block") and not tq.DISABLE_TRITON_KERNEL):
        raise SystemExit("ModelOpt does not take its Triton NVFP4 path here (needs sm_89+ and triton)")
    fp8_ext = tq.get_cuda_ext_fp8(raise_if_failed=False) is not None
    assert gk.install()
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)

    t0 = time.time()
    check_lines, bad = run_checks(gk, nv, tq, gen, fp8_ext)
    lines = [
        "# qarl GPU fake-quant kernels vs ModelOpt's GPU paths",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        f"modelopt {modelopt.__version__}; `python {' '.join(sys.argv)}`",
        "- NVFP4 reference: ModelOpt's Triton `fp4_fake_quant_block`; FP8 reference: "
        + ("the CUDA extension `fake_e4m3fy`" if fp8_ext else
           "`fp8_eager` (the CUDA extension could not be built: ModelOpt falls back to it)"),
        f"- qarl config: NVFP4 {gk.NVFP4_BLOCKS_PER_PROGRAM} blocks x {gk.NVFP4_NUM_WARPS} warps, "
        f"FP8 {gk.FP8_BLOCK} elements x {gk.FP8_NUM_WARPS} warps; checks took {time.time() - t0:.0f} s",
        *ptx_ops(gk),
        f"- **{bad} differing elements in all.**",
        "",
        *check_lines,
        "",
        *run_timing(gk, tq, gen),
    ]
    if args.tune:
        lines += ["", *run_tune(gk, gen)]
    report = "\n".join(lines) + "\n"
    Path(args.out).write_text(report)
    print(report)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
