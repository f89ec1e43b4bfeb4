"""Fast GPU fake quantization (NVFP4, FP8 E4M3 per tensor), bit-identical to ModelOpt 0.47's GPU kernels.

qarl keeps one numerical contract per format for training, rollout and export (nvfp4_cpu.py is the CPU port
of NVFP4's). These kernels only make the GPU side fast: every value is computed by the same fp32 operations,
in the same order, as ModelOpt's own GPU code, so they change no bit (benchmarks/fake_quant_gpu_check.py checks
that on a GPU). Only the organisation differs: NVFP4 takes 32 blocks a program as a [32, 16] tile, computes the
global scale in the kernel and needs one launch.

NVFP4, replacing ModelOpt's Triton NVFP4 kernel (behind the CUDA kernel of its block op,
`modelopt_compat.dynamic_block_quantize`, on sm_89+). Blocks are 16 consecutive elements of the last dim (a
ragged last block is zero-padded); fp32 throughout, the result cast to ``x.dtype`` (RNE):

- ``g = fl32(amax * fl32(1/2688))`` (ModelOpt's CUDA tensor / Python-scalar division multiplies by the fp32
  reciprocal); ``g <= 0`` -> 1e-12.
- ``s = fl32(e4m3(min(bmax / fl32(6 g), 448)) * g)`` (Triton's RNE cast to e4m3), ``s < 1e-5`` -> 1.0;
  ``r = |x| / s``. Both divisions are Triton's fp32 ``/`` (PTX div.full.f32: ``a * rcp.approx(b)``, not IEEE).
- ``q`` = E2M1 magnitude by ModelOpt's thresholds (``<= .25`` -> 0, ``< .75`` -> .5, ``<= 1.25`` -> 1,
  ``< 1.75`` -> 1.5, ``<= 2.5`` -> 2, ``< 3.5`` -> 3, ``<= 5`` -> 4, else 6); ``y = q * s``, and ``-y`` where
  ``x < 0``: Triton's unary minus. Up to Triton 3.6 that is ``0 - y``, so -0 becomes +0 (the contract nvfp4_cpu
  encodes); Triton builds with triton-lang/triton#10270 negate with fneg instead, in both kernels alike.

FP8 E4M3 per tensor, replacing ModelOpt's CUDA extension ``fake_e4m3fy`` (behind the CUDA kernel of its scaled
op, `modelopt_compat.scaled_quantize`, with num_bits 8, exponent_bits 4, scalar amax), built without
--use_fast_math, so its divisions are IEEE (``tl.math.div_rn`` here):

- ``a = amax`` as fp32, ``a <= 2^-24`` -> 1; ``scale = 448 / a``, ``inv = 1 / scale``;
- ``y = fl32(e4m3(x * scale)) * inv`` cast to ``x.dtype``; the e4m3 cast rounds to nearest even and saturates
  to +-448 (``__nv_fp8_e4m3`` is SATFINITE; here an explicit NaN-preserving clamp).
- Where the extension cannot be built ModelOpt falls back to ``fp8_eager``, whose ``448.0 / amax`` is torch's
  ``amax.reciprocal() * 448``: ``eager=True`` reproduces that instead.

Launching: a forward that quantizes its layers' inputs waits on its host. The first launch of each
specialization goes through Triton; the compiled function is then launched from C++ (launch.cpp, built once per
machine, checked bit for bit against Triton's launch), or else by Triton's compiled-kernel runner.

Not matched: NaN payloads (NaN stays NaN). Anything else ModelOpt's ops are called with (other formats,
per-channel amax, fp64, CPU tensors, block_size != 16) goes to ModelOpt's implementation.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import warnings
from typing import Any

import torch

from qarl.quant.modelopt_compat import (NVFP4_OP_ARGS, fp8_extension_missing, modelopt_dynamic_block_quantize,
                                        modelopt_scaled_quantize, override_op_kernels, runs_triton_nvfp4)
from qarl.torch_compat import destroy_library

# Elements per program and warps: the fastest NVFP4 setting measured on an H100 (8 elements a thread);
# benchmarks/fake_quant_gpu_check.py --tune compares others (benchmarks/results/gpu/README.md).
NVFP4_BLOCKS_PER_PROGRAM, NVFP4_NUM_WARPS = 32, 2  # 16-element blocks: 512 elements
FP8_BLOCK, FP8_NUM_WARPS = 2048, 4

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Set by _kernels() on first use, so importing this module never imports triton. The kernels read
# `tl` from these module globals: the Triton interpreter (TRITON_INTERPRET=1) only patches a
# triton.language it finds there, not one captured in a closure.
triton: Any = None
tl: Any = None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_cols", "blocks_per_row", "n_blocks"])
    def nvfp4_kernel(x_ptr, y_ptr, amax_ptr, n_cols, blocks_per_row, n_blocks,
                     BLOCKS: tl.constexpr, EVEN: tl.constexpr):
        """BLOCKS 16-element blocks per program, one per tile row, so a block's max is a row max."""
        blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        lane = tl.arange(0, 16)
        if EVEN:  # n_cols % 16 == 0: block b is elements [16 b, 16 b + 16) of the flat tensor
            start = tl.program_id(0).to(tl.int64) * (BLOCKS * 16)
            x_ptr += start
            y_ptr += start
            offs = tl.arange(0, BLOCKS)[:, None] * 16 + lane[None, :]
            mask = (blk < n_blocks)[:, None]
        else:  # ragged rows: the last block of each row is masked (zero-padded)
            row = blk // blocks_per_row
            col = (blk - row * blocks_per_row)[:, None] * 16 + lane[None, :]
            offs = row.to(tl.int64)[:, None] * n_cols + col
            mask = (blk < n_blocks)[:, None] & (col < n_cols)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

        g = tl.load(amax_ptr).to(tl.float32) * 0.00037202381645329297  # exactly fl32(1/2688)
        g = tl.where(g > 0.0, g, 1e-12)
        x_abs = tl.abs(x)
        s = tl.max(x_abs, axis=1, keep_dims=True) / (6.0 * g)
        s = tl.minimum(s, 448.0).to(tl.float8e4nv).to(tl.float32) * g
        s = tl.where(s >= 1e-5, s, 1.0)

        r = x_abs / s
        q = tl.where(r <= 5.0, 4.0, 6.0)
        q = tl.where(r < 3.5, 3.0, q)
        q = tl.where(r <= 2.5, 2.0, q)
        q = tl.where(r < 1.75, 1.5, q)
        q = tl.where(r <= 1.25, 1.0, q)
        q = tl.where(r < 0.75, 0.5, q)
        q = tl.where(r <= 0.25, 0.0, q)
        y = q * s
        y = tl.where(x >= 0, y, -y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # n stays specialised: n % 16 == 0 lets the masked loads vectorise
    def fp8_kernel(x_ptr, y_ptr, amax_ptr, n, BLOCK: tl.constexpr, EAGER: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)
        mask = offs < n - start
        a = tl.load(amax_ptr).to(tl.float32)
        a = tl.where(a <= 5.960464477539063e-08, 1.0, a)  # 2^-24
        if EAGER:
            scale = tl.math.div_rn(1.0, a) * 448.0
        else:
            scale = tl.math.div_rn(448.0, a)
        inv = tl.math.div_rn(1.0, scale)
        x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = x * scale
        q = tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL)
        q = tl.minimum(q, 448.0, propagate_nan=tl.PropagateNan.ALL)
        y = q.to(tl.float8e4nv).to(tl.float32) * inv
        tl.store(y_ptr + start + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    return nvfp4_kernel, fp8_kernel


_COMPILED: dict[tuple, tuple[Any, list]] = {}  # launch key -> (compiled kernel, its constexprs in order)


def _launch(kernel: Any, grid: tuple[int], x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor, *ints: int,
            launcher: Any = None, **meta: Any) -> None:
    """Launch `kernel(x, y, amax, *ints, **meta)` on x's device (Triton launches on the current one): the
    Python path, for a call the C++ `launcher` of this kernel and these options did not take.

    The first launch of each specialization goes through Triton's `kernel[grid](...)`, which compiles the
    kernel or finds it compiled; it is then registered with `launcher` (`_register`), which launches it
    from there on, and held here for Triton's compiled-kernel runner, which launches it where the launcher
    does not (no launcher, or a specialization it does not take), without Triton's per-call argument
    binding, cache-key and option handling. The key holds all in the arguments that Triton specializes a
    launch on: the pointers' dtypes and 16-byte alignment (only aligned pointers are held), each
    integer's divisibility by 16, equality to 1 and width, the constexprs and the launch options, so a hit
    runs the kernel Triton itself would pick for them (Triton's process-wide debug settings are not in it:
    they are read at the first launch)."""
    device = x.get_device()
    aligned = (x.data_ptr() | y.data_ptr() | amax.data_ptr()) % 16 == 0
    key = (kernel, device, x.dtype, y.dtype, amax.dtype, tuple([(n % 16 == 0, n == 1, n < 2**31) for n in ints]),
           tuple(meta.items())) if aligned and device >= 0 else None
    held = _COMPILED.get(key) if key is not None else None
    switch = device >= 0 and device != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        if held is not None:
            compiled, constexprs = held
            compiled[(*grid, 1, 1)[:3]](x, y, amax, *ints, *constexprs)  # a compiled kernel takes a 3-D grid
        else:
            compiled = kernel[grid](x, y, amax, *ints, **meta)
            # held from a launch outside CUDA graph capture, where the launcher's bits can be checked
            if key is not None and compiled is not None and not torch.cuda.is_current_stream_capturing():
                _COMPILED[key] = (compiled, [meta[name] for name in kernel.arg_names[3 + len(ints):]])
                if launcher is not None:
                    _register(launcher, compiled, x, y, amax, ints)


def _register(launcher: Any, compiled: Any, x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor,
              ints: tuple[int, ...]) -> None:
    """Let the C++ `launcher` launch `compiled`, which Triton has just launched with these arguments into y,
    where that is the very same launch: the same compiled function (the same bits), on one CTA per program
    with `32 * num_warps` threads and the kernel's shared memory, with the parameters Triton passes (the
    pointers and integers in order, then Triton's scratch pointers, null: these kernels use no scratch).
    Registered only where the kernel's PTX entry declares exactly those parameters (an integer Triton
    specialized away, as it does a 1, is missing there, and the launcher takes no integer argument of 1)
    and needs nothing else (no cluster, cooperative or PDL launch, no scratch), and kept only if
    the launcher's output for these arguments equals Triton's bit for bit; anything else stays with
    Triton's launch (a difference with a warning)."""
    meta = compiled.metadata
    if (getattr(meta, "num_ctas", 1) != 1
            or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False)
            or getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
            or not getattr(compiled, "function", None)):
        return
    try:
        params = _ptx_params(compiled.asm["ptx"], compiled.name)
    except (KeyError, ValueError):
        return
    widths = ["u32" if n < 2**31 else "u64" for n in ints]
    scratch = params[3 + len(ints):]
    if ([_unsigned(t) for t in params[:3 + len(ints)]] != ["u64"] * 3 + widths or len(scratch) > 2
            or any(_unsigned(t) != "u64" for t in scratch)):
        return
    if not launcher.add(x, amax, compiled.function, 32 * meta.num_warps, meta.shared,
                        [4 if t == "u32" else 8 for t in widths], len(scratch)):
        return
    again = launcher(x, amax)
    if again is None or not torch.equal(again.view(torch.uint8), y.view(torch.uint8)):
        launcher.drop(x, amax)
        if again is not None:
            warnings.warn(f"qarl: the C++ launch of Triton kernel {compiled.name} changed its output; keeping "
                          "Triton's launcher for it (slower, the same bits)", RuntimeWarning, stacklevel=4)


@functools.cache
def _extension() -> Any:
    """qarl/quant/kernels/launch.cpp, compiled once per machine by torch's extension builder (ninja and
    a C++ compiler, which Triton needs too), or None with a warning where it cannot be built: the kernels
    then launch through Triton's runner (the same bits, more host time a call)."""
    from pathlib import Path

    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(name="qarl_launch", sources=[str(Path(__file__).with_name("launch.cpp"))],
                                  extra_cflags=["-O2"])
    except Exception as e:  # noqa: BLE001 - any build failure leaves the Python launch path
        warnings.warn(f"qarl: could not build its C++ kernel launcher ({type(e).__name__}: {e}); fake quant launches "
                      "through Triton (the same bits, more host time a call). Install ninja and a C++ compiler "
                      "to get it.", RuntimeWarning, stacklevel=2)
        return None


_LAUNCHERS: dict[tuple, Any] = {}  # (nvfp4, per_program, num_warps, eager) -> the C++ Launcher, or None


def _launcher(nvfp4: bool, per_program: int, num_warps: int, eager: bool = False) -> Any:
    """The C++ launcher of one kernel and its launch options (constexprs other than NVFP4's EVEN, which
    follows from n_cols, in its key), or None where the extension cannot be built."""
    key = (nvfp4, per_program, num_warps, eager)
    if key not in _LAUNCHERS:
        extension = _extension()
        _LAUNCHERS[key] = extension.Launcher(nvfp4, per_program) if extension is not None else None
    return _LAUNCHERS[key]


def _ptx_params(ptx: str, name: str) -> list[str]:
    """The parameter types (`u64`, `u32`, ...) of PTX entry `name`, in order."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError(f"no entry {name} in the PTX")
    return re.findall(r"\.param\s+\.(\w+)", match.group(1))


def _unsigned(ptx_type: str) -> str:
    """A PTX parameter type by width alone (`s32`/`b32` -> `u32`): Triton declares its integer parameters by width."""
    return "u" + ptx_type[1:]


def _prepare(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x contiguous (the kernels index it flat) and amax on x's device, or an error for what they do not take."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"fake quant supports {_DTYPES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("fake quant needs a tensor with at least one dim")
    return x.contiguous(), amax.to(x.device)  # (no detach: the kernels read the raw memory, outside autograd)


def nvfp4_fake_quant_cuda(
    x: torch.Tensor,
    amax: torch.Tensor,
    block_size: int = 16,
    blocks_per_program: int = NVFP4_BLOCKS_PER_PROGRAM,
    num_warps: int = NVFP4_NUM_WARPS,
) -> torch.Tensor:
    """NVFP4 quantize-dequantize of x along its last dim; x's dtype and shape, contiguous.

    amax: the per-tensor amax (a device tensor; several elements: their max, as ModelOpt's op).
    No autograd: ModelOpt's DynamicBlockQuantizationFunction around the op gives the STE gradient.
    CUDA tensors (CPU tensors only under TRITON_INTERPRET=1).
    """
    if block_size != 16:
        raise ValueError(f"NVFP4 blocks are 16 elements (ModelOpt's GPU kernel), got {block_size}")
    x, amax = _prepare(x, amax)
    return _nvfp4(x, amax if amax.numel() == 1 else amax.amax(), blocks_per_program, num_warps)


def _nvfp4(x: torch.Tensor, amax: torch.Tensor, blocks_per_program: int = NVFP4_BLOCKS_PER_PROGRAM,
           num_warps: int = NVFP4_NUM_WARPS) -> torch.Tensor:
    """The NVFP4 kernel on a contiguous x and a one-element amax on x's device."""
    launcher = _launcher(True, blocks_per_program, num_warps) if x.is_cuda else None
    if launcher is not None and (y := launcher(x, amax)) is not None:
        return y
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    n_cols = x.shape[-1]
    blocks_per_row = -(-n_cols // 16)
    n_blocks = x.numel() // n_cols * blocks_per_row
    if n_blocks >= 2**31 - blocks_per_program:
        raise ValueError(f"tensor too large for the NVFP4 kernel: {n_blocks} blocks")
    grid = (-(-n_blocks // blocks_per_program),)
    _launch(_kernels()[0], grid, x, y, amax, n_cols, blocks_per_row, n_blocks, launcher=launcher,
            BLOCKS=blocks_per_program, EVEN=n_cols % 16 == 0, num_warps=num_warps)
    return y


def fp8_fake_quant_cuda(
    x: torch.Tensor,
    amax: torch.Tensor,
    eager: bool = False,
    block: int = FP8_BLOCK,
    num_warps: int = FP8_NUM_WARPS,
) -> torch.Tensor:
    """FP8 E4M3 per-tensor quantize-dequantize of x (scale 448 / amax); x's dtype and shape.

    Bits of ModelOpt's CUDA extension ``fake_e4m3fy``; ``eager=True``: of its fallback ``fp8_eager``.
    amax: one element, a device tensor. No autograd (ModelOpt's ScaledE4M3Function gives the STE).
    CUDA tensors (CPU tensors only under TRITON_INTERPRET=1).
    """
    if amax.numel() != 1:
        raise ValueError(f"fp8_fake_quant_cuda is per tensor: amax must have one element, got {amax.numel()}")
    x, amax = _prepare(x, amax)
    return _fp8(x, amax, eager, block, num_warps)


def _fp8(x: torch.Tensor, amax: torch.Tensor, eager: bool, block: int = FP8_BLOCK,
         num_warps: int = FP8_NUM_WARPS) -> torch.Tensor:
    """The FP8 kernel on a contiguous x and a one-element amax on x's device."""
    launcher = _launcher(False, block, num_warps, eager) if x.is_cuda else None
    if launcher is not None and (y := launcher(x, amax)) is not None:
        return y
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    _launch(_kernels()[1], (-(-x.numel() // block),), x, y, amax, x.numel(), launcher=launcher,
            BLOCK=block, EAGER=eager, num_warps=num_warps)
    return y


def available() -> bool:
    """True where these kernels can replace ModelOpt's: CUDA with native FP8 (sm_89+) and triton.

    Below sm_89 ModelOpt's NVFP4 path is a different (CUDA extension) kernel, and Triton has no e4m3.
    """
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (8, 9)
        and importlib.util.find_spec("triton") is not None
    )


_LIB: torch.library.Library | None = None


def _takes(x: torch.Tensor) -> bool:
    """x is what these kernels quantize: a CUDA tensor of a float dtype they handle, with a dim."""
    return x.is_cuda and x.dtype in _DTYPES and x.dim() > 0


def _replaces_nvfp4(inputs: torch.Tensor, block_size: int, amax: torch.Tensor, args: tuple) -> bool:
    """The installed block op runs `nvfp4_fake_quant_cuda` for these operands: where ModelOpt would run its
    Triton NVFP4 kernel (`modelopt_compat.runs_triton_nvfp4`), whose bits it has."""
    return (args == NVFP4_OP_ARGS
            and block_size == 16  # ModelOpt's Triton path ignores block_size: leave others to it
            and amax.is_cuda and _takes(inputs) and runs_triton_nvfp4())


def _replaces_fp8(inputs: torch.Tensor, amax: torch.Tensor, num_bits: int, exponent_bits: int) -> bool:
    """The installed scaled op runs `fp8_fake_quant_cuda` for these operands (per-tensor E4M3)."""
    return (num_bits == 8 and exponent_bits == 4 and amax.numel() == 1 and _takes(inputs)
            and amax.device == inputs.device)


def fake_quant(x: torch.Tensor, amax: torch.Tensor, nvfp4: bool, block_size: int = 16) -> torch.Tensor | None:
    """What the installed op computes for an NVFP4 (the block op with E2M1 values and E4M3 block scales of
    `block_size`) or FP8 E4M3 (the scaled op) fake quantization of x, called without the op's dispatch, for
    eager callers that quantize in every layer. FP8 takes the bits of ModelOpt's extension, or of its eager
    fallback where the extension is not built (`modelopt_compat.fp8_extension_missing`).
    None where the op would run ModelOpt's own implementation (not installed, other operands)."""
    if _LIB is None:
        return None
    if nvfp4:
        return nvfp4_fake_quant_cuda(x, amax) if _replaces_nvfp4(x, block_size, amax, NVFP4_OP_ARGS) else None
    return fp8_fake_quant_cuda(x, amax, eager=fp8_extension_missing()) if _replaces_fp8(x, amax, 8, 4) else None


class BoundFakeQuant:
    """`fake_quant(x, amax, nvfp4)` for one calibrated amax (one element, on a CUDA device) and the
    format's 16-element blocks, for a caller that quantizes at every layer of every forward (the policy's
    input quantizers, `FastInputMixin`, in a forward that waits on its host). What depends on the amax and
    the format alone is settled at the first call: FP8's choice of ModelOpt's extension or eager bits, and
    the kernel's C++ launcher, which then takes a whole call (x's checks, the output, the launch) in one
    step. Returns None wherever `fake_quant` would (the op then runs ModelOpt's code): the kernels not
    installed, x not a CUDA tensor of the amax's device and a handled dtype, or ModelOpt's NVFP4
    switched off its Triton kernel."""

    __slots__ = ("amax", "nvfp4", "device", "eager", "launcher")

    def __init__(self, amax: torch.Tensor, nvfp4: bool):
        if amax.numel() != 1 or not amax.is_cuda:
            raise ValueError(f"BoundFakeQuant needs a one-element CUDA amax, got {tuple(amax.shape)} on {amax.device}")
        self.amax, self.nvfp4, self.device = amax, nvfp4, amax.get_device()
        self.eager: bool | None = None  # settled at the first call, with the kernels installed
        self.launcher: Any = None

    def __reduce__(self) -> tuple:
        """A copy (a deep-copied or pickled quantizer holds one) settles again at its first call: the
        C++ launcher is this process's."""
        return BoundFakeQuant, (self.amax, self.nvfp4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if _LIB is None or (self.nvfp4 and not runs_triton_nvfp4()):
            return None
        if self.eager is None:
            self.eager = not self.nvfp4 and fp8_extension_missing()
            self.launcher = (_launcher(True, NVFP4_BLOCKS_PER_PROGRAM, NVFP4_NUM_WARPS) if self.nvfp4
                             else _launcher(False, FP8_BLOCK, FP8_NUM_WARPS, self.eager))
        if self.launcher is not None and (y := self.launcher(x, self.amax)) is not None:
            return y
        if not _takes(x) or x.get_device() != self.device:
            return None
        x = x.contiguous()
        return _nvfp4(x, self.amax) if self.nvfp4 else _fp8(x, self.amax, self.eager)


def install() -> bool:
    """Route ModelOpt's NVFP4 and per-tensor FP8 fake quant on CUDA through these kernels (idempotent).

    Overrides the CUDA kernels of the two torch.library ops ModelOpt's autograd Functions call (the block op
    for NVFP4, the scaled op for FP8: `modelopt_compat.override_op_kernels`, so no ModelOpt function is
    patched and no quant config changes). A call is taken only where ModelOpt would run the kernel replaced
    here, with the same bits; every other call goes to ModelOpt's own implementation. CPU kernels are
    untouched (nvfp4_cpu.install() handles NVFP4 on CPU).
    Returns False (and does nothing) without CUDA sm_89+ or triton.
    """
    global _LIB
    if _LIB is not None:
        return True
    if not available():
        return False

    def dynamic_block_quantize_cuda(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits,
                                    scale_exponent_bits):
        args = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        if _replaces_nvfp4(inputs, block_size, amax, args):
            return nvfp4_fake_quant_cuda(inputs, amax)
        return modelopt_dynamic_block_quantize(inputs, block_size, amax, *args)

    def quantize_cuda(inputs, amax, num_bits, exponent_bits, unsigned, narrow_range):
        if _replaces_fp8(inputs, amax, num_bits, exponent_bits):
            return fp8_fake_quant_cuda(inputs, amax, eager=fp8_extension_missing())
        return modelopt_scaled_quantize(inputs, amax, num_bits, exponent_bits, unsigned, narrow_range)

    _LIB = override_op_kernels("CUDA", dynamic_block_quantize=dynamic_block_quantize_cuda, quantize=quantize_cuda)
    return True


def uninstall() -> None:
    """Give the two ops' CUDA kernels back to ModelOpt (for comparisons; no-op if not installed)."""
    global _LIB
    if _LIB is not None:
        destroy_library(_LIB)
        _LIB = None


@contextlib.contextmanager
def modelopt_kernels():
    """Run the body with ModelOpt's own CUDA kernels, re-installing these afterwards if they were."""
    was = _LIB is not None
    uninstall()
    try:
        yield
    finally:
        if was:
            install()
