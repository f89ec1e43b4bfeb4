"""qarl's CPU NVFP4 kernel: against a reference written from the format, through ModelOpt, on GPU.

The reference below is a per-element loop in numpy float32 scalars: nearest E2M1 / E4M3 value by
explicit search (ties to the even code), the kernel's scale arithmetic, and the kernel's division
``fl32(a * rcp(b))``. Its only shared piece is ``_gpu_rcp``, tested on its own against values
measured on an H100 (benchmarks/nvfp4_gpu_check.py checks all 2^23 mantissas there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qarl.quant.kernels import nvfp4_cpu as nv

F32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E4M3 = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][
    :127
]  # code = e << 3 | m, 0x00..0x7E (0x7F is NaN)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# rcp.approx.ftz.f32 on an H100 (sm_90): (input bits, output bits). The first eight differ from the
# IEEE 1/x by +1 / -1 ulp, the last four equal it.
HW_RCP = [
    (0x3FD14E8D, 0x3F1C8E0B), (0x3FD79234, 0x3F18016B), (0x3FEF6C04, 0x3F08DCED),
    (0x3FF63410, 0x3F0517DE), (0x3F81E5FF, 0x3F7C4236), (0x3F8FB3B7, 0x3F640705),
    (0x3F9306D1, 0x3F5EDF06), (0x3F94CD97, 0x3F5C35E2), (0x3F918A05, 0x3F612629),
    (0x3FC0E149, 0x3F29E354), (0x3FE68ADD, 0x3F0E2265), (0x3FE97559, 0x3F0C5BEB),
]


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


def _rcp(b: np.float32) -> np.float32:
    return F32(nv._gpu_rcp(torch.tensor([b], dtype=torch.float32)).item())


def _nearest(v: float, grid: list[float]) -> float:
    """Nearest grid value to v >= 0; ties go to the even index (even code); beyond the grid: last."""
    best = min(range(len(grid)), key=lambda i: (abs(v - grid[i]), i % 2))
    return grid[best]


def reference(x: torch.Tensor, amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake-quantized x, block scales), one element at a time."""
    last = x.shape[-1]
    xs = x.float().reshape(-1, last).numpy()
    g = F32(amax) * F32(1.0 / 2688.0)
    g = g if g > 0 else F32(1e-12)
    rcp6 = _rcp(F32(6.0) * g)
    out = np.zeros_like(xs)
    scales = np.zeros((xs.shape[0], -(-last // 16)), dtype=np.float32)
    for r in range(xs.shape[0]):
        for b, start in enumerate(range(0, last, 16)):
            blk = xs[r, start : start + 16]
            ratio = min(F32(max(abs(v) for v in blk) * rcp6), F32(448.0))
            s = F32(F32(_nearest(float(ratio), E4M3)) * g)
            s = s if s >= F32(1e-5) else F32(1.0)
            scales[r, b] = s
            rs = _rcp(s)
            for i, v in enumerate(blk):
                y = F32(F32(_nearest(float(F32(abs(v) * rs)), E2M1)) * s)
                out[r, start + i] = y if v >= 0 else F32(0.0) - y
    y = torch.from_numpy(out).reshape(x.shape).to(x.dtype)
    return y, torch.from_numpy(scales).reshape(*x.shape[:-1], -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _midpoints(dtype: torch.dtype, gen: torch.Generator, ulps: int = 0) -> torch.Tensor:
    """Blocks whose elements sit at t * scale, t an E2M1 midpoint. amax 336 makes the global scale
    exactly 1/8, so t * scale is exact in every dtype (ulps=0) or `ulps` away from it."""
    bmax = (torch.rand(6, 4, generator=gen) * 0.99 + 0.01) * 336
    bmax[0, 0] = 336.0
    x = torch.zeros(6, 4, 16)
    x[..., 0] = bmax.to(dtype).float()
    s, _ = nv.nvfp4_block_scales(x.reshape(6, 64).to(dtype), torch.tensor(336.0))
    t = torch.tensor(MIDPOINTS)[torch.randint(0, 7, (6, 4, 15), generator=gen)]
    v = (t * s.unsqueeze(-1)).to(dtype)
    if ulps:
        step = torch.randint(-ulps, ulps + 1, v.shape, generator=gen).to(INT_VIEW[dtype])
        v = (v.view(INT_VIEW[dtype]) + step).view(dtype)
    sign = torch.where(torch.rand(v.shape, generator=gen) < 0.5, -1.0, 1.0)
    x[..., 1:] = v.float() * sign
    return x.reshape(6, 64)


def _dataset(name: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(DATASETS.index(name))
    if name == "normal":
        return torch.randn(6, 64, generator=gen).to(dtype)
    if name == "student_t":
        z = torch.randn(6, 64, generator=gen)
        chi = torch.randn(6, 64, 2, generator=gen).pow(2).sum(-1)  # chi2 with 2 dof
        return (z / (chi / 2).sqrt()).clamp(-1e4, 1e4).to(dtype)
    if name == "zero_and_tiny_blocks":
        x = torch.randn(6, 4, 16, generator=gen)
        x[0, 1] = 0
        x[2] = 0
        x[3, 2] *= 1e-7
        x[4, :2] *= 1e-3
        return x.reshape(6, 64).to(dtype)
    if name == "midpoints":
        return _midpoints(dtype, gen).to(dtype)
    if name == "near_midpoints":
        return _midpoints(dtype, gen, ulps=1).to(dtype)
    if name == "pow2":
        k = torch.randint(0, 10, (6, 64), generator=gen).float()
        return (torch.where(torch.rand(6, 64, generator=gen) < 0.5, -1.0, 1.0) * 0.5**k).to(dtype)
    if name == "ragged_3d":
        return torch.randn(2, 3, 37, generator=gen).to(dtype)
    raise KeyError(name)


DATASETS = ["normal", "student_t", "zero_and_tiny_blocks", "midpoints", "near_midpoints", "pow2", "ragged_3d"]


@pytest.fixture(scope="module")
def mtq():
    import modelopt.torch.quantization as mtq

    nv.install()
    return mtq


def _tensor_quantizer(mtq, config_name: str, **extra):
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    entries = getattr(mtq, config_name)["quant_cfg"]
    cfg = next(e["cfg"] for e in entries if e["quantizer_name"] == "*weight_quantizer")
    return TensorQuantizer(QuantizerAttributeConfig(**{**cfg, **extra}))


# ------------------------------------------------------------------------------------- kernel
def test_gpu_rcp_matches_measured_hardware_values():
    for x_bits, y_bits in HW_RCP:
        for k in (-20, 0, 30):  # the unit works on the mantissa: rcp(x * 2^k) = rcp(x) * 2^-k
            got = nv._gpu_rcp(_f32(x_bits) * 2.0**k)
            assert same_bits(got, _f32(y_bits) * 2.0**-k), hex(x_bits)
    powers = torch.tensor([2.0**k for k in range(-100, 100)])
    assert same_bits(nv._gpu_rcp(powers), 1.0 / powers)


def test_gpu_rcp_is_faithful():
    b = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e3 + 1e-3
    r = nv._gpu_rcp(b).double()
    lo = torch.nextafter((1 / b.double()).float(), torch.tensor(0.0)).double()
    hi = torch.nextafter((1 / b.double()).float(), torch.tensor(1e9)).double()
    assert ((r >= lo) & (r <= hi)).all()
    assert (r != (1 / b).double()).any()  # not the IEEE reciprocal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", DATASETS)
def test_matches_reference(name, dtype):
    x = _dataset(name, dtype)
    top = float(x.float().abs().amax())
    for amax in (top, top / 2, top * 2):
        want, want_scales = reference(x, amax)
        got = nv.nvfp4_fake_quant(x, torch.tensor(amax))
        assert got.shape == x.shape and same_bits(got, want), (name, amax)
        scales, g = nv.nvfp4_block_scales(x, torch.tensor(amax))
        assert torch.equal(scales, want_scales)
        assert g.item() == F32(amax) * F32(1.0 / 2688.0)


def test_scale_tables_are_kept_per_global_scale_and_left_unchanged():
    """The per-amax tables (128 emulated reciprocals, most of a small tensor's cost) are computed once per
    global scale value: a repeated amax reuses them, another amax gets its own, and using them changes nothing."""
    x = _dataset("midpoints", torch.float32)
    first, second = float(x.abs().amax()), float(x.abs().amax()) * 3
    nv._scale_tables.cache_clear()
    want = {a: reference(x, a)[0] for a in (first, second)}
    for amax in (first, second, first, first, second):
        assert same_bits(nv.nvfp4_fake_quant(x, torch.tensor(amax)), want[amax])
    info = nv._scale_tables.cache_info()
    assert (info.misses, info.hits) == (2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_midpoint_data_has_ties(dtype):
    """Keep the tie tests honest: the data must put elements exactly on E2M1 midpoints."""
    x = _dataset("midpoints", dtype)
    s, _ = nv.nvfp4_block_scales(x, x.float().abs().amax())
    q = x.float().abs().reshape(6, 4, 16).double() / s.unsqueeze(-1).double()
    assert sum(int((q == t).sum()) for t in MIDPOINTS) >= 300


def test_zero_output_has_no_negative_zero():
    x = torch.tensor([[-1e-6, -0.0, 0.0, 1e-6] + [-1.0] * 12])
    y = nv.nvfp4_fake_quant(x, torch.tensor(1.0))
    assert not torch.signbit(y[0, :4]).any()
    assert (y[0, 4:] == -1.0).all()


# ----------------------------------------------------------------------------------- ModelOpt
@pytest.mark.parametrize("config_name", ["NVFP4_DEFAULT_CFG", "W4A16_NVFP4_CFG"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tensor_quantizer_runs_qarl_on_cpu(mtq, config_name, dtype):
    tq = _tensor_quantizer(mtq, config_name)
    x = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = tq(x)
    assert same_bits(y, nv.nvfp4_fake_quant(x, x.abs().amax()))
    assert not torch.equal(y, x)


def test_install_is_idempotent(mtq):
    lib = nv._LIB
    nv.install()
    assert nv._LIB is lib
    x = torch.randn(4, 32)
    got = torch.ops.tensorrt.dynamic_block_quantize_op(x, 16, x.abs().amax(), 4, 2, 8, 4)
    assert same_bits(got, nv.nvfp4_fake_quant(x, x.abs().amax()))


def test_other_formats_go_to_modelopt(mtq, monkeypatch):
    from modelopt.torch.quantization import tensor_quant

    calls = []

    def fake(*args):
        calls.append(args[3:])
        return args[0] + 1

    monkeypatch.setattr(tensor_quant, "_dynamic_block_quantize_impl", fake)
    x = torch.randn(4, 32)
    op = torch.ops.tensorrt.dynamic_block_quantize_op
    assert torch.equal(op(x, 32, x.abs().amax(), 4, 0, 8, 4), x + 1)  # NVINT4 -> ModelOpt
    assert calls == [(4, 0, 8, 4)]
    op(x, 16, x.abs().amax(), 4, 2, 8, 4)  # NVFP4 -> qarl
    assert len(calls) == 1


def test_fp8_unaffected(mtq):
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    y = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))(x)
    scale = 448.0 / x.abs().amax()
    want = (x * scale).to(torch.float8_e4m3fn).float() * (1 / scale)
    assert same_bits(y, want)


def test_straight_through_gradient(mtq):
    tq = _tensor_quantizer(mtq, "NVFP4_DEFAULT_CFG")
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(3), requires_grad=True)
    up = torch.randn(4, 48)
    tq(x).backward(up)
    assert torch.equal(x.grad, up)

    clip = _tensor_quantizer(mtq, "NVFP4_DEFAULT_CFG", pass_through_bwd=False)
    amax = x.detach().abs().amax() / 2
    clip.amax = amax
    x.grad = None
    clip(x).backward(up)
    inside = x.detach().abs() <= amax
    assert (~inside).any()
    assert torch.equal(x.grad, torch.where(inside, up, 0.0))


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_equals_cuda(mtq, dtype):
    op = torch.ops.tensorrt.dynamic_block_quantize_op
    gen = torch.Generator().manual_seed(4)
    for name in DATASETS:
        x = _dataset(name, dtype)
        for xx in (x, torch.randn(256, 896, generator=gen).to(dtype)):
            top = xx.float().abs().amax()
            for amax in (top, top / 2, top * 2):
                gpu = op(xx.cuda(), 16, amax.cuda(), 4, 2, 8, 4).cpu()
                assert same_bits(nv.nvfp4_fake_quant(xx, amax), gpu), (name, float(amax))


# ------------------------------------------------------------ static block scales (MSE, 4-over-6)
def test_static_port_rounds_a_scaled_grid_exactly_and_ties_to_even():
    """Values on the E2M1 grid times a power-of-two scale come back unchanged; midpoints go to the even
    neighbour (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); negatives that
    round to zero come out +0.0 (Triton's unary minus is 0 - y); a zero scale zeroes its block."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 6.0])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -7.0, 0.1, -0.1, 0, 0, 0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 6.0, -6.0, 0.0, 0.0, 0, 0, 0])
    x = torch.stack([grid * 0.25, ties * 0.25, grid])
    y = nv.static_nvfp4_fake_quant(x, torch.tensor([0.25, 0.25, 0.0]))
    assert same_bits(y[0], grid * 0.25)
    assert same_bits(y[1], want * 0.25) and not torch.signbit(y[1][want == 0]).any()
    assert same_bits(y[2], torch.zeros(16))


def test_static_formats_run_on_cpu_through_modelopt(mtq):
    """ModelOpt's 4-over-6 and MSE-sweep NVFP4 formats calibrate and quantize on CPU (their static weight
    kernel is Triton-only in ModelOpt); the weight quantizer's output is the port applied with its own
    calibrated block scales, and gradients pass straight through inside the block amax."""
    for name in ("NVFP4_FOUR_OVER_SIX_CFG", "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
        mtq.quantize(model, getattr(mtq, name), lambda m: m(x))
        layer = model[0]
        q = layer.weight_quantizer
        assert q.is_nvfp4_static and q.amax.numel() == 32 * 64 // 16
        from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

        scales = nv.static_block_scales(q.amax, q.global_amax, fp8_max_for_normalization(q))
        with torch.no_grad():
            assert same_bits(q(layer.weight), nv.static_nvfp4_fake_quant(layer.weight, scales)), name
        w = layer.weight.detach().clone().requires_grad_(True)
        q(w).sum().backward()
        assert w.grad is not None and torch.isfinite(w.grad).all()
