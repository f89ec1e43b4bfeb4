"""qarl's implementations of ModelOpt's two fake-quant ops, the same bits as ModelOpt's own: a CPU port of
its NVFP4 kernel (`nvfp4_cpu`) and fast GPU kernels for NVFP4 and FP8 (`gpu`, launched from C++ by
launch.cpp)."""

from __future__ import annotations

from qarl.quant.kernels import gpu, nvfp4_cpu


def install() -> None:
    """Register every kernel that applies here (the NVFP4 CPU port always; the GPU kernels with CUDA sm_89+
    and triton): idempotent, and needed before a process's first quantized call."""
    nvfp4_cpu.install()
    gpu.install()
