"""Bit-for-bit check of qarl's CPU NVFP4 fake quant against ModelOpt's GPU kernel.

Needs a CUDA GPU of compute capability >= 8.9 (ModelOpt then takes its Triton path) and
nvidia-modelopt; run from anywhere:

    python benchmarks/nvfp4_gpu_check.py --out report.md

Every case is made on the GPU and fake-quantized there by ModelOpt (the op
``tensorrt::dynamic_block_quantize_op`` and ``TensorQuantizer`` with the NVFP4 config), then moved
to the CPU and fake-quantized by qarl (``nvfp4_fake_quant``, the op after ``install()``, and
ModelOpt's ``TensorQuantizer`` after ``install()``) and by the kernel's steps written out plainly
with candidate formulations of its fp32 division. Outputs are compared on their raw bits. The
report also checks qarl's emulation of the GPU's reciprocal over all 2^23 mantissas.
``--explore DIR`` also writes the measured reciprocal table and the kernel's PTX (diagnostics).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def load_nvfp4_cpu():
    """Load qarl/quant/kernels/nvfp4_cpu.py by path: the rest of qarl (vLLM, ...) is not needed here."""
    spec = importlib.util.spec_from_file_location("nvfp4_cpu", ROOT / "qarl/quant/kernels/nvfp4_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- GPU reciprocal and division
def make_gpu_fns():
    """rcp.approx.ftz.f32 and Triton's fp32 `/`, as torch functions running on the GPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rcp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
        y = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
        tl.store(y_ptr + offs, y, mask=offs < n)

    @triton.jit
    def _div_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(a_ptr + offs, mask=offs < n, other=1.0)
        b = tl.load(b_ptr + offs, mask=offs < n, other=1.0)
        tl.store(y_ptr + offs, a / b, mask=offs < n)

    def hw_rcp(b: torch.Tensor) -> torch.Tensor:
        x = b.detach().float().cuda().contiguous().reshape(-1)
        y = torch.empty_like(x)
        _rcp_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y.reshape(b.shape).to(b.device)

    def triton_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(a)
        _div_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, y, a.numel(), BLOCK=1024)
        return y

    return hw_rcp, triton_div


# ---------------------------------------------------------------- candidate formulations (CPU)
def rcp_rz(b: torch.Tensor) -> torch.Tensor:
    """1/b rounded toward zero (the IEEE reciprocal, one ulp down where it rounded up)."""
    r = torch.reciprocal(b)
    up = r.double() * b.double() > 1.0  # exact: a 24x24-bit product fits a double
    return torch.where(up, torch.nextafter(r, torch.zeros_like(r)), r)


def kernel_formulation(x: torch.Tensor, amax: torch.Tensor, div) -> torch.Tensor:
    """The Triton kernel's steps written out plainly in torch, its fp32 `/` replaced by div."""
    last = x.shape[-1]
    rows = x.numel() // last
    xf = torch.nn.functional.pad(x.reshape(rows, last).float(), (0, -last % 16)).view(-1, 16)
    g = amax.float().amax().reshape(()) * (1.0 / 2688.0)  # CUDA's tensor / scalar
    g = torch.where(g > 0.0, g, 1e-12)
    ratio = torch.fmin(div(xf.abs().amax(1, keepdim=True), 6.0 * g), torch.tensor(448.0))
    s = ratio.to(torch.float8_e4m3fn).float() * g
    s = torch.where(s >= 1e-5, s, 1.0)
    q = div(xf.abs(), s)
    v = torch.full_like(q, 6.0)
    for t, strict, val in reversed(
        [(0.25, 0, 0.0), (0.75, 1, 0.5), (1.25, 0, 1.0), (1.75, 1, 1.5),
         (2.5, 0, 2.0), (3.5, 1, 3.0), (5.0, 0, 4.0)]
    ):
        v = torch.where(q < t if strict else q <= t, val, v)
    y = v * s
    y = torch.where(xf >= 0, y, 0.0 - y)  # the kernel negates as fma(-s, q, 0.0)
    return y.view(rows, -1)[:, :last].reshape(x.shape).to(x.dtype)


def candidates(hw_rcp, nv):
    """Formulations tried for the kernel's fp32 `/` (PTX div.full.f32)."""
    return {
        "ieee_div": lambda a, b: a / b,
        "mul_rcp_rn": lambda a, b: a * torch.reciprocal(b),
        "mul_rcp_rz": lambda a, b: a * rcp_rz(b),
        "mul_hw_rcp": lambda a, b: a * hw_rcp(b),  # rcp.approx.ftz.f32 taken from the GPU
        "mul_emulated_rcp": lambda a, b: a * nv._gpu_rcp(b),  # qarl's emulation of it
    }


# ---------------------------------------------------------------- cases
def _blockify(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1, 16)


def _set_block_max(x: torch.Tensor, bmax: torch.Tensor, gen) -> torch.Tensor:
    """Put |bmax| (per block, random sign) at element 0 of each 16-block; others stay below it."""
    xb = _blockify(x).clone()
    sign = torch.where(torch.rand(bmax.shape, device=x.device, generator=gen) < 0.5, -1.0, 1.0)
    xb[..., 0] = bmax * sign
    return xb.reshape(x.shape)


def _midpoint_fill(x32, nv, amax, dtype, gen, ulps: int):
    """Elements 1..15 of each block at t*scale, t a midpoint of E2M1, moved by up to `ulps` ulps."""
    s, _ = nv.nvfp4_block_scales(x32.to(dtype).cpu(), amax.cpu())
    s = s.to(x32.device).unsqueeze(-1)
    xb = _blockify(x32).clone()
    t = torch.tensor(MIDPOINTS, device=x32.device)[
        torch.randint(0, len(MIDPOINTS), xb[..., 1:].shape, device=x32.device, generator=gen)
    ]
    sign = torch.where(torch.rand(t.shape, device=x32.device, generator=gen) < 0.5, -1.0, 1.0)
    v = (t * s).to(dtype)
    if ulps:
        iv = INT_VIEW[dtype]
        step = torch.randint(-ulps, ulps + 1, v.shape, device=x32.device, generator=gen)
        v = (v.view(iv) + step.to(iv)).view(dtype)
    xb[..., 1:] = v.float() * sign
    return xb.reshape(x32.shape).to(dtype)


def make_cases(nv, gen, dev: str = "cuda"):
    """Yield (name, dtype name, amax mode, x, amax or None for 'amax = max'), made on `dev`."""

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    def student_t(*shape, df=3.0):
        z = randn(*shape)
        chi2 = torch._standard_gamma(torch.full(shape, df / 2, device=dev)) * 2  # chi2(df)
        return z / torch.sqrt(chi2 / df)

    for dname, dtype in DTYPES.items():
        base = {
            "normal": randn(256, 1024),
            "weight_0.02": randn(512, 896) * 0.02,
            "student_t3": student_t(256, 1024),
            "student_t1.5": student_t(128, 1024, df=1.5).clamp(-6e4, 6e4),
        }
        x = randn(256, 1024)
        x = _blockify(x)
        x[torch.rand(x.shape[:2], device=dev, generator=gen) < 0.3] = 0
        base["zero_blocks"] = x.reshape(256, 1024)
        x = _blockify(randn(256, 1024))
        tiny = torch.rand(x.shape[:2], device=dev, generator=gen) < 0.3
        x[tiny] *= 10.0 ** torch.randint(-9, -4, (int(tiny.sum()), 1), device=dev, generator=gen)
        base["tiny_blocks"] = x.reshape(256, 1024)
        base["row_scaled"] = randn(256, 1024) * 10.0 ** (
            torch.rand(256, 1, device=dev, generator=gen) * 6 - 3
        )
        x = randn(256, 1024)
        x[torch.rand(256, device=dev, generator=gen) < 0.03] *= 300.0
        base["outlier_rows"] = x
        x = randn(4, 37, 896) * 2
        x[..., torch.randint(0, 896, (6,), device=dev, generator=gen)] *= 50.0
        base["act3d_outlier_ch"] = x
        base["ragged_33x100"] = randn(33, 100)
        base["ragged_7x13"] = randn(7, 13)
        base["ragged_3d_5x3x40"] = randn(5, 3, 40)
        # dyadic data: |x| = amax * 2^-k hits the kernel's 0.75 near-ties at scale 448
        k = torch.randint(0, 12, (256, 1024), device=dev, generator=gen).float()
        sign = torch.where(torch.rand(256, 1024, device=dev, generator=gen) < 0.5, -1.0, 1.0)
        base["pow2_grid"] = sign * 0.5 ** k
        # block grid data: every value a small integer times a power of two
        base["int_grid"] = torch.randint(-64, 65, (256, 1024), device=dev, generator=gen) / 64.0
        for name, x in base.items():
            x = x.to(dtype)
            amax_max = x.abs().amax().float()
            for mode, amax in (("max", None), ("max/2", amax_max / 2), ("2max", amax_max * 2)):
                yield f"{name}", dname, mode, x, amax

        # E2M1 midpoints. Global scale exactly 2^-3 (amax = 2688/8): |x|/scale is exactly a
        # midpoint in every dtype. Random amax: exact or near midpoints depending on the dtype.
        for label, amax_val in (("exact", 336.0), ("random_amax", None)):
            for ulps in (0, 2):
                bm = torch.rand(256, 64, device=dev, generator=gen) * 0.99 + 0.01
                if amax_val is None:
                    top = float(torch.rand((), device=dev, generator=gen)) * 100 + 1
                else:
                    top = amax_val
                top = float(torch.tensor(top).to(dtype))
                bm = (bm * top).to(dtype).float()
                bm[0, 0] = top
                x32 = _set_block_max(torch.zeros(256, 1024, device=dev), bm, gen)
                for mode, f in (("max", None), ("max/2", 0.5), ("2max", 2.0)):
                    amax = torch.tensor(top, device=dev) * (f or 1.0)
                    x = _midpoint_fill(x32, nv, amax, dtype, gen, ulps)
                    tag = f"midpoints_{label}" + (f"_pm{ulps}ulp" if ulps else "")
                    yield tag, dname, mode, x, (None if f is None else amax)


# ---------------------------------------------------------------- comparison helpers
def mismatches(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mask of elements whose raw bits differ."""
    iv = INT_VIEW[a.dtype]
    return a.contiguous().view(iv) != b.contiguous().view(iv)


def tie_masks(nv, x: torch.Tensor, amax: torch.Tensor):
    """Elements whose exact |x|/scale is an E2M1 midpoint (tie), or within 2 fp32 ulps (near)."""
    s, _ = nv.nvfp4_block_scales(x, amax)
    last = x.shape[-1]
    a = nv._blocks(x, 16).abs().double()
    q = (a / s.reshape(a.shape[0], -1, 1).double()).reshape(a.shape[0], -1)[:, :last]
    q = q.reshape(x.shape)
    tie = torch.zeros_like(q, dtype=torch.bool)
    near = torch.zeros_like(tie)
    for t in MIDPOINTS:
        tie |= q == t
        near |= (q - t).abs() <= 2 * 2.0**-23 * t
    return tie, near & ~tie


def median_ms(fn, n: int = 20) -> float:
    fn()
    ts = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def rcp_checks(nv, hw_rcp, triton_div) -> list[str]:
    """qarl's rcp emulation vs the GPU over all 2^23 mantissas; Triton `/` vs a*rcp(b)."""
    xs = (torch.arange(1 << 23, device="cuda", dtype=torch.int32) | 0x3F800000).view(torch.float32)
    hw = hw_rcp(xs)
    em = nv._gpu_rcp(xs)
    rn = (1.0 / xs.double()).float()
    g = torch.Generator(device="cuda").manual_seed(1)
    xr = xs[torch.randint(0, 1 << 23, (1 << 20,), device="cuda", generator=g)]
    scaled_bad = sum(
        int(mismatches(nv._gpu_rcp(xr * 2.0**k), hw_rcp(xr * 2.0**k)).sum()) for k in (-100, -7, 5, 100)
    )
    lines = [
        f"- qarl's `_gpu_rcp` vs the GPU's `rcp.approx.ftz.f32` over all 2^23 mantissas in [1, 2): "
        f"{int(mismatches(em, hw).sum())} differ; on 2^20 random mantissas times 2^k, "
        f"k in (-100, -7, 5, 100): {scaled_bad} differ. (The GPU's rcp differs from the IEEE 1/x "
        f"in {int(mismatches(hw, rn).sum())} of the 2^23.)",
    ]
    n = 1 << 24
    a = torch.rand(n, device="cuda", generator=g) * 10 ** (torch.rand(n, device="cuda", generator=g) * 8 - 4)
    b = torch.rand(n, device="cuda", generator=g) * 10 ** (torch.rand(n, device="cuda", generator=g) * 8 - 4)
    t = torch.tensor(MIDPOINTS, device="cuda")[torch.randint(0, 7, (n,), device="cuda", generator=g)]
    step = torch.randint(-2, 3, (n,), device="cuda", generator=g, dtype=torch.int32)
    a_mid = ((t * b).view(torch.int32) + step).view(torch.float32)
    for label, aa in (("random pairs", a), ("pairs within 2 ulps of a midpoint quotient", a_mid)):
        d = triton_div(aa, b)
        lines.append(
            f"- Triton fp32 `/` vs `a * rcp.approx(b)`, {n} {label}: "
            f"{int(mismatches(d, aa * hw_rcp(b)).sum())} differ (vs IEEE `a / b`: "
            f"{int(mismatches(d, aa / b).sum())} differ)"
        )
    return lines


def run_check(args) -> str:
    import modelopt
    import modelopt.torch.quantization as mtq
    import triton
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    torch.manual_seed(args.seed)
    nv = load_nvfp4_cpu()
    nv.install()
    hw_rcp, triton_div = make_gpu_fns()
    cands = candidates(hw_rcp, nv)
    op = torch.ops.tensorrt.dynamic_block_quantize_op
    cfg = next(
        e["cfg"] for e in mtq.NVFP4_DEFAULT_CFG["quant_cfg"] if e["quantizer_name"] == "*weight_quantizer"
    )
    tq_gpu = TensorQuantizer(QuantizerAttributeConfig(**cfg)).cuda()
    tq_cpu = TensorQuantizer(QuantizerAttributeConfig(**cfg))

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows, examples, totals = [], [], {}
    t0 = time.time()
    for name, dname, mode, x, amax in make_cases(nv, gen):
        amax_dyn = amax is None
        if amax_dyn:
            amax = x.abs().amax().float()
        ref = op(x, 16, amax, 4, 2, 8, 4)  # ModelOpt's GPU path (Triton)
        xc, ac, refc = x.cpu(), amax.cpu(), ref.cpu()
        tie, near = tie_masks(nv, xc, ac)
        res = {"qarl": mismatches(nv.nvfp4_fake_quant(xc, ac), refc)}
        res["op_cpu"] = mismatches(op(xc, 16, ac, 4, 2, 8, 4), refc)
        res["tq_cpu"] = mismatches(tq_cpu(xc), refc) if amax_dyn else None
        res["tq_gpu"] = mismatches(tq_gpu(x), ref).cpu() if amax_dyn else None
        for cname, div in cands.items():
            res[cname] = mismatches(kernel_formulation(xc, ac, div), refc)
        agg = totals.setdefault(dname, {"elements": 0, "ties": 0, "near": 0})
        agg["elements"] += x.numel()
        agg["ties"] += int(tie.sum())
        agg["near"] += int(near.sum())
        for cname, m in res.items():
            if m is None:
                continue
            for key, sel in ((cname, m), (cname + "@tie", m & tie), (cname + "@near", m & near)):
                agg[key] = agg.get(key, 0) + int(sel.sum())
        counts = {c: ("-" if m is None else int(m.sum())) for c, m in res.items()}
        rows.append((name, dname, mode, tuple(x.shape), x.numel(), int(tie.sum()), int(near.sum()), counts))
        bad = res["qarl"]
        if bad.any() and len(examples) < 30:
            s, _ = nv.nvfp4_block_scales(xc, ac)
            out = nv.nvfp4_fake_quant(xc, ac)
            for i in bad.reshape(-1).nonzero()[:3, 0].tolist():
                r, c = divmod(i, xc.shape[-1])
                sc = s.reshape(-1, s.shape[-1])[r, c // 16]
                xv = xc.reshape(-1)[i].float()
                examples.append(
                    f"| {name} | {dname} | {mode} | {xv.item()!r} | {sc.item()!r} | "
                    f"{(xv.abs().double() / sc.double()).item()!r} | {refc.reshape(-1)[i].item()!r} | "
                    f"{out.reshape(-1)[i].item()!r} |"
                )
    elapsed = time.time() - t0

    # ModelOpt's Triton path ignores block_size (always 16): record it.
    xb = torch.randn(64, 256, device="cuda", generator=gen)
    am = xb.abs().amax()
    bs_ignored = torch.equal(op(xb, 32, am, 4, 2, 8, 4), op(xb, 16, am, 4, 2, 8, 4))
    w = torch.randn(4864, 896, device="cuda", generator=gen)
    wa = w.abs().amax()
    gpu_ms = median_ms(lambda: op(w, 16, wa, 4, 2, 8, 4))
    wc, wac = w.cpu(), wa.cpu()
    cpu_ms = median_ms(lambda: nv.nvfp4_fake_quant(wc, wac), n=10)

    cnames = list(rows[0][7].keys())
    lines = [
        "# NVFP4 fake quant: qarl CPU vs ModelOpt GPU, bit for bit",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"modelopt {modelopt.__version__}; triton {triton.__version__}; "
        f"`python benchmarks/nvfp4_gpu_check.py --seed {args.seed}`",
        "- reference: `torch.ops.tensorrt.dynamic_block_quantize_op` on CUDA (ModelOpt's Triton "
        f"kernel `fp4_fake_quant_block`), amax passed explicitly; {len(rows)} cases in {elapsed:.0f} s.",
        "- columns count elements whose raw bits differ from that reference. `qarl` = "
        "`nvfp4_fake_quant` on CPU; `op_cpu` = the op on CPU after `install()`; `tq_cpu` / `tq_gpu` = "
        "ModelOpt's `TensorQuantizer` (NVFP4_DEFAULT_CFG weight config, dynamic amax) on CPU after "
        "`install()` / on CUDA (amax = max cases only). The other columns are the kernel's steps "
        "written out plainly (`kernel_formulation`) with its fp32 division as: `ieee_div` a/b, "
        "`mul_rcp_rn` a*RN(1/b), `mul_rcp_rz` a*RZ(1/b), `mul_hw_rcp` a*rcp.approx.ftz.f32(b) taken "
        "from the GPU, `mul_emulated_rcp` a*`_gpu_rcp`(b) (qarl's emulation).",
        "- `ties`: elements whose exact |x|/scale is an E2M1 midpoint; `near`: within 2 fp32 ulps "
        "of one (not exact); `@tie` / `@near`: mismatches among those.",
        f"- the op with block_size=32 equals block_size=16 on the GPU (the Triton path ignores it): "
        f"{bs_ignored}",
        f"- 4864x896 fp32, median: GPU op {gpu_ms:.3f} ms; qarl `nvfp4_fake_quant` on this host's CPU "
        f"({torch.get_num_threads()} threads) {cpu_ms:.1f} ms",
        *rcp_checks(nv, hw_rcp, triton_div),
        "",
        "## Totals per dtype (mismatching elements)",
        "",
        "| dtype | elements | ties | near | " + " | ".join(cnames) + " |",
        "|---|---|---|---|" + "---|" * len(cnames),
    ]
    for dname, agg in totals.items():
        cells = [
            f"{agg.get(c, 0)} ({agg.get(c + '@tie', 0)}@tie, {agg.get(c + '@near', 0)}@near)"
            for c in cnames
        ]
        lines.append(
            f"| {dname} | {agg['elements']} | {agg['ties']} | {agg['near']} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "## Per case",
        "",
        "| case | dtype | amax | shape | elements | ties | near | " + " | ".join(cnames) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(cnames),
    ]
    for name, dname, mode, shape, n, nt, nn, counts in rows:
        lines.append(
            f"| {name} | {dname} | {mode} | {'x'.join(map(str, shape))} | {n} | {nt} | {nn} | "
            + " | ".join(str(counts[c]) for c in cnames) + " |"
        )
    if examples:
        lines += [
            "",
            "## First mismatches of `qarl`",
            "",
            "| case | dtype | amax | x | scale | exact abs(x)/scale | GPU | qarl |",
            "|---|---|---|---|---|---|---|---|",
            *examples,
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- diagnostics
def explore(out_dir: Path) -> str:
    """Write the GPU's rcp over all mantissas (int8 ulps from IEEE 1/x) and the kernel's PTX."""
    hw_rcp, _ = make_gpu_fns()
    xs = (torch.arange(1 << 23, device="cuda", dtype=torch.int32) | 0x3F800000).view(torch.float32)
    delta = hw_rcp(xs).view(torch.int32) - (1.0 / xs.double()).float().view(torch.int32)
    (out_dir / "rcp_delta_i8.bin").write_bytes(delta.to(torch.int8).cpu().numpy().tobytes())
    vals, counts = torch.unique(delta, return_counts=True)
    lines = [
        "",
        "## Diagnostics (--explore)",
        "",
        "- rcp.approx.ftz.f32 minus IEEE 1/x, in ulps, over the 2^23 mantissas: "
        + ", ".join(f"{v}: {c}" for v, c in zip(vals.tolist(), counts.tolist()))
        + " (written to rcp_delta_i8.bin, mantissa order)",
    ]
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache"))
    for i, p in enumerate(sorted(cache.rglob("fp4_fake_quant_kernel.ptx"))):
        ptx = p.read_text()
        if i < 3:  # one compiled variant per dtype is plenty to read
            (out_dir / p.parent.name[:16]).with_suffix(".ptx").write_text(ptx)
        ops = sorted({ln.split()[0] for ln in ptx.splitlines() if ln.strip() and any(
            k in ln for k in ("div", "rcp", "cvt.rn", "min.", "max.", "fma", "mul.f32", "neg"))})
        lines.append(f"- kernel PTX ({p.parent.name[:16]}.ptx) ops of interest: {', '.join(ops)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="nvfp4_gpu_check.md", help="markdown report path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--explore", type=Path, default=None, help="folder for diagnostic dumps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (compute capability >= 8.9) and nvidia-modelopt")
    report = run_check(args)
    if args.explore:
        args.explore.mkdir(parents=True, exist_ok=True)
        report += explore(args.explore)
    Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
