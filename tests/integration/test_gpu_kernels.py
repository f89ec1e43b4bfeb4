"""qarl's GPU fake-quant kernels (qarl/quant/kernels/gpu.py): bit for bit against ModelOpt's own GPU
paths, and through ModelOpt's TensorQuantizer after install() (outputs and STE gradients).

The GPU tests skip without CUDA sm_89+ and triton. Two tests run anywhere: install() is a no-op
without CUDA, and the NVFP4 kernel runs in Triton's interpreter (TRITON_INTERPRET=1, a subprocess).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qarl.quant.kernels import gpu as gk
from qarl.quant import resolve_format
from tests.conftest import REPO

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NVFP4_OP_ARGS = (4, 2, 8, 4)

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not gk.available(), reason="needs CUDA sm_89+ and triton")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype])))


def cases(dtype: torch.dtype):
    """(x, amax) on the GPU: normal, heavy tails, zero and tiny blocks, ragged and 3-D; amax max, max/2, 2max."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    normal = torch.randn(64, 256, device="cuda", generator=gen)
    heavy = normal / torch.rand(64, 256, device="cuda", generator=gen).clamp_min(0.01)
    blocks = torch.randn(64, 16, 16, device="cuda", generator=gen)
    blocks[::3] = 0
    blocks[1::3] *= 1e-7
    for x in (normal, heavy, blocks.view(64, 256), torch.randn(7, 40, device="cuda", generator=gen),
              torch.randn(2, 8, 64, device="cuda", generator=gen) * 3):
        x = x.to(dtype)
        for f in (1.0, 0.5, 2.0):
            yield x, x.float().abs().amax() * f


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_matches_modelopt_triton_kernel(dtype):
    from modelopt.torch.quantization import tensor_quant

    for x, amax in cases(dtype):
        ref = tensor_quant._dynamic_block_quantize_impl(x, 16, amax, *NVFP4_OP_ARGS)
        assert same_bits(gk.nvfp4_fake_quant_cuda(x, amax), ref)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_matches_modelopt_extension_and_eager(dtype):
    from modelopt.torch.quantization import tensor_quant

    ext = tensor_quant.get_cuda_ext_fp8(raise_if_failed=False) is not None
    for x, amax in [*cases(dtype), (torch.zeros(8, 32, device="cuda", dtype=dtype), torch.zeros((), device="cuda"))]:
        ref = tensor_quant._quantize_impl(x, amax, 8, 4, False, False)  # extension, or fp8_eager without it
        assert same_bits(gk.fp8_fake_quant_cuda(x, amax, eager=not ext), ref)
        assert same_bits(gk.fp8_fake_quant_cuda(x, amax, eager=True), tensor_quant.fp8_eager(x, amax))


@gpu
@needs_gpu
def test_install_delegates_what_it_does_not_replace():
    from modelopt.torch.quantization import tensor_quant

    assert gk.install() and gk.install()  # idempotent
    x = torch.randn(32, 64, device="cuda").to(torch.bfloat16)
    amax = x.float().abs().amax()
    # block_size 32: ModelOpt's own path (its Triton kernel ignores the block size)
    got = torch.ops.tensorrt.dynamic_block_quantize_op(x, 32, amax, *NVFP4_OP_ARGS)
    assert same_bits(got, tensor_quant._dynamic_block_quantize_impl(x, 32, amax, *NVFP4_OP_ARGS))
    # per-channel FP8: ModelOpt's extension
    amax_rows = x.float().abs().amax(1, keepdim=True)
    got = torch.ops.tensorrt.quantize_op(x, amax_rows, 8, 4, False, False)
    assert same_bits(got, tensor_quant._quantize_impl(x, amax_rows, 8, 4, False, False))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_call_without_dispatch_is_the_op(dtype):
    """`fake_quant` (the op's kernel without its dispatch) gives the installed op's bits where the op runs
    qarl's kernel, and declines (None) what the op leaves to ModelOpt."""
    assert gk.install()
    for x, amax in cases(dtype):
        op = torch.ops.tensorrt
        assert same_bits(gk.fake_quant(x, amax, nvfp4=True), op.dynamic_block_quantize_op(x, 16, amax, *NVFP4_OP_ARGS))
        assert same_bits(gk.fake_quant(x, amax, nvfp4=False), op.quantize_op(x, amax, 8, 4, False, False))
    x = torch.randn(32, 64, device="cuda", dtype=dtype)
    assert gk.fake_quant(x, x.abs().amax(), nvfp4=True, block_size=32) is None
    assert gk.fake_quant(x, x.abs().amax(1, keepdim=True), nvfp4=False) is None
    assert gk.fake_quant(x.double(), x.abs().amax(), nvfp4=True) is None


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_fake_quant_is_the_op(dtype, monkeypatch):
    """`BoundFakeQuant` (what the policy's input quantizers call) gives the installed op's bits, on
    contiguous and strided inputs alike, and declines (None) what the op would leave to ModelOpt."""
    from modelopt.torch.quantization import tensor_quant

    assert gk.install()
    op = torch.ops.tensorrt
    for x, amax in cases(dtype):
        for x in (x, x.transpose(-1, -2)):
            assert same_bits(gk.BoundFakeQuant(amax, nvfp4=True)(x), op.dynamic_block_quantize_op(x, 16, amax, *NVFP4_OP_ARGS))
            assert same_bits(gk.BoundFakeQuant(amax, nvfp4=False)(x), op.quantize_op(x, amax, 8, 4, False, False))
    bound = gk.BoundFakeQuant(amax, nvfp4=True)
    assert bound(x) is not None and bound.launcher is not None  # the C++ launcher, settled at the first call
    assert same_bits(copy.deepcopy(bound)(x), bound(x))  # a deep-copied quantizer holds a copy: it settles again
    assert bound(x.double()) is None and bound(x.cpu()) is None
    monkeypatch.setattr(tensor_quant, "DISABLE_TRITON_KERNEL", True)  # ModelOpt then runs its CUDA extension
    assert bound(x) is None and gk.BoundFakeQuant(amax, nvfp4=False)(x) is not None
    with pytest.raises(ValueError, match="one-element CUDA amax"):
        gk.BoundFakeQuant(amax.cpu(), nvfp4=True)


@gpu
@needs_gpu
def test_cpp_launcher_keeps_triton_specialization():
    """The compiled kernels launched by the C++ launcher (second call on) give the bits of the first,
    Triton-launched call, and the launcher holds one kernel per specialization; a pointer that is not
    16-byte aligned, which Triton compiles apart, an integer argument of 1, which Triton specializes away,
    and an amax of another dtype (another specialization) are not launched from a kernel registered for
    another."""
    from modelopt.torch.quantization import tensor_quant

    gk._COMPILED.clear()
    gk._LAUNCHERS.clear()
    base = torch.randn(4097, 896, device="cuda").to(torch.bfloat16)
    amax = base.float().abs().amax()
    eager = tensor_quant.get_cuda_ext_fp8() is None
    nvfp4 = gk._launcher(True, gk.NVFP4_BLOCKS_PER_PROGRAM, gk.NVFP4_NUM_WARPS)
    fp8 = gk._launcher(False, gk.FP8_BLOCK, gk.FP8_NUM_WARPS, eager)
    assert nvfp4 is not None and fp8 is not None, "the C++ launcher did not build (see the warning)"
    unaligned = base.view(-1)[1:1 + 4096 * 896].view(4096, 896)
    for x in (base[:4096], base[:4096], unaligned, base[:4096], base[:4096].transpose(0, 1)):
        ref = tensor_quant._dynamic_block_quantize_impl(x.contiguous(), 16, amax, *NVFP4_OP_ARGS)
        assert same_bits(gk.nvfp4_fake_quant_cuda(x, amax), ref)
        ref = tensor_quant._quantize_impl(x.contiguous(), amax, 8, 4, False, False)
        assert same_bits(gk.fp8_fake_quant_cuda(x, amax, eager=eager), ref)
    assert nvfp4(unaligned, amax) is None and fp8(unaligned, amax) is None
    assert len(nvfp4) == 2 and len(fp8) == 1  # NVFP4's blocks per row: 56 for 896 columns, 256 for 4096
    assert fp8(base[:4096], amax.to(torch.bfloat16)) is None and nvfp4(base[:4096], amax.half()) is None
    one = base[:1, :1]  # FP8's element count 1: a constant in Triton's specialization, not a parameter
    for _ in range(2):
        assert same_bits(gk.fp8_fake_quant_cuda(one, amax, eager=eager), tensor_quant._quantize_impl(one, amax, 8, 4, False, False))
    assert fp8(one, amax) is None and len(fp8) == 1
    ragged = torch.randn(3, 40, device="cuda", dtype=torch.float16)  # n_cols % 16 != 0: EVEN=False
    for _ in range(2):
        ref = tensor_quant._dynamic_block_quantize_impl(ragged, 16, amax, *NVFP4_OP_ARGS)
        assert same_bits(gk.nvfp4_fake_quant_cuda(ragged, amax), ref)
    assert len(nvfp4) == 3


@gpu
@needs_gpu
@pytest.mark.parametrize("fmt", ["nvfp4_w4a4", "fp8_w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_quantizer_same_outputs_and_gradients(fmt, dtype, monkeypatch):
    """A model quantized by mtq.quantize with qarl's configs: identical with ModelOpt's kernels and with qarl's."""
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    model = model.to("cuda", dtype)
    x = torch.randn(4, 16, 256, device="cuda", dtype=dtype)
    mtq.quantize(model, resolve_format(fmt).modelopt_cfg, forward_loop=lambda m: m(x))

    def run() -> list[torch.Tensor]:
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.float().square().mean().backward()
        return [out.detach(), xi.grad, *(p.grad for p in model.parameters())]

    assert gk.install()
    with gk.modelopt_kernels():
        ref = run()
    calls = []
    name = "nvfp4_fake_quant_cuda" if fmt.startswith("nvfp4") else "fp8_fake_quant_cuda"
    kernel = getattr(gk, name)
    monkeypatch.setattr(gk, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got = run()
    assert calls, f"qarl's {name} was not called"
    for a, b in zip(ref, got):
        assert same_bits(a, b)


def test_install_is_a_noop_without_cuda():
    if gk.available():
        pytest.skip("CUDA sm_89+ present")
    assert gk.install() is False
    assert gk._LIB is None


# Tie-free data for the interpreter, whose fp32 `/` is IEEE (the GPU's is a * rcp.approx(b): an exact
# E2M1 midpoint may round differently) and whose float8 / bf16 casts are approximate (no ties to even,
# bf16 truncated): so every block max is exactly 6 * (an E4M3 code) * g with g = 2^-3, the block
# scales are exact, no |x| / s comes within 1% of a midpoint, and the outputs are exact in every dtype.
# Zeros are compared as values: their sign follows the installed Triton's unary minus (the GPU check's job).
_INTERPRETER_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from qarl.quant.kernels import gpu as gk, nvfp4_cpu as nv

    gen = torch.Generator().manual_seed(0)
    amax = torch.tensor(2688.0 / 8)
    g = float(amax * nv.INV_GLOBAL_SCALE)
    assert g == 0.125, g
    codes = nv._E4M3_CODES[(nv._E4M3_CODES >= 2**-6) & (nv._E4M3_CODES <= 448)]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    bad = []
    for shape in [(32, 64), (5, 40), (2, 3, 48), (100,)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            last, rows = shape[-1], torch.Size(shape[:-1]).numel()
            nb = -(-last // 16)
            s = (codes[torch.randint(0, len(codes), (rows, nb), generator=gen)] * g).repeat_interleave(16, 1)
            r = torch.rand(rows, nb * 16, generator=gen) * 6.0
            r.view(rows, nb, 16)[..., 0] = 6.0
            sign = torch.where(torch.rand(r.shape, generator=gen) < 0.5, -1.0, 1.0)
            x = (sign * r * s)[:, :last].to(dtype)
            q = x.double().abs() / s[:, :last].double()
            x[((q[..., None] - mids).abs() < 0.01 * mids).any(-1)] = 0
            x = x.reshape(shape)
            y = gk.nvfp4_fake_quant_cuda(x, amax, blocks_per_program=8)
            ref = nv.nvfp4_fake_quant(x, amax)
            if y.dtype != x.dtype or not torch.equal(y, ref):
                bad.append((shape, dtype, int((y != ref).sum())))
    print(bad)
    sys.exit(1 if bad else 0)
""")


def test_nvfp4_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


VARIANTS = [(True, False, False), (False, True, False), (True, True, False), (True, False, True), (True, True, True)]


def variant_kernel_mismatches(device: str) -> list[tuple]:
    """The NVFP4 input variants' Triton kernel (nvfp4_variant_gpu) against their torch function on `device`, bit for
    bit: random rows spanning five decades, zeros and tiny negatives, ragged widths, rows of more blocks than a
    program takes at a time, NaN and inf inputs, and planted ties (a row max and an amax of 2688 make the global
    scale 1.0, per token and per tensor; a block max of 6 * s makes the block's scale s, a power of two or 448, and
    puts its other elements on E2M1's midpoints; a block max of 102 puts its scale on a tie of E4M3's, 17 between 16
    and 18). The cases that differ, with the count of elements."""
    from qarl.quant.input_variants import fake_quant_reference
    from qarl.quant.kernels import nvfp4_variant_gpu

    gen = torch.Generator().manual_seed(0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0, 0.5, 3.0, 1.5, 4.0, 2.0, 1.0])
    tied = torch.cat([torch.cat([torch.tensor([6.0 * s]), -mids * s]) for s in (448.0, 2.0**-3, 1.0, 4.0)]
                     + [torch.tensor([102.0] + [0.5 * 17] * 15)]).reshape(1, 80)
    cases = [(tied, torch.tensor(2688.0))]
    for shape in [(3, 64), (5, 40), (2, 3, 300), (4, 7)]:
        x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
        x.view(-1)[::7] = 0.0
        x.view(-1)[3::11] *= -1e-4
        cases.append((x, x.abs().amax() * 0.7))
    poisoned = cases[1][0].clone()
    poisoned[1, 5], poisoned[2, 40] = float("nan"), float("inf")  # a non-finite input stays non-finite, as in torch
    cases.append((poisoned, cases[1][1]))
    bad = []
    for x, amax in cases:
        for dtype in DTYPES:
            xd, ad = x.to(dtype).to(device), amax.to(device)
            for per_token, four_over_six, hadamard in VARIANTS:
                ref = fake_quant_reference(xd, ad, per_token, four_over_six, hadamard)
                y = nvfp4_variant_gpu.fake_quant(xd, ad, per_token, four_over_six, hadamard)
                nan = ref.isnan()  # where both are NaN their payloads may differ
                bits_differ = y.view(INT_VIEW[dtype]) != ref.view(INT_VIEW[dtype])
                differ = int((y.isnan() != nan).sum() + bits_differ[~nan].sum())
                if y.dtype != dtype or differ:
                    bad.append((tuple(x.shape), dtype, per_token, four_over_six, hadamard, differ))
    return bad


def test_nvfp4_variant_kernel_in_triton_interpreter():
    """The variant kernel's arithmetic is the torch function's, checked on CPU in Triton's interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = ("from tests.integration.test_gpu_kernels import variant_kernel_mismatches as m; "
              "bad = m('cpu'); print(bad); raise SystemExit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@gpu
@needs_gpu
def test_nvfp4_variant_kernel_is_the_torch_function_on_the_gpu():
    """Compiled for the GPU (divisions correctly rounded, no fused multiply-adds), the variant kernel gives the torch
    function's bits there too, and the op runs it on CUDA tensors."""
    from qarl.quant.input_variants import Variant, fake_quant, fake_quant_reference

    assert variant_kernel_mismatches("cuda") == []
    x, amax = torch.randn(8, 96, device="cuda", dtype=torch.bfloat16), torch.tensor(3.0, device="cuda")
    assert torch.equal(fake_quant(x, amax, Variant(four_over_six=True)),
                       fake_quant_reference(x, amax, False, True, False))
