"""A qlora policy's frozen 4-bit base served packed by vLLM's own kernel (`policy.generation.packed_base`).

A qlora base never changes, so the engine need not hold it folded in the compute dtype (2 bytes a bf16 weight)
nor take it in a refit: the run writes the policy's base once as a ModelOpt NVFP4 W4A16 checkpoint (qarl's
exporter writes the policy's own codes and scales, bit for bit: `qarl/run.py`, `packed_engine_base`) and vLLM starts
from it, computing each quantized linear layer from its 0.5625 bytes a weight with its FP4 Marlin kernel (vLLM's
W4A16 NVFP4 path; the one it has on Hopper). Refits then bring the adapters (vLLM's LoRA, vllm_lora.py) and any
frozen weight that does change (QeRL's noise on the norms); a packed weight is never sent.

Numerics: Marlin dequantizes the same codes and scales the policy decodes, then multiplies in its own order, so the
engine's log-probs differ from the policy's at the compute dtype's floor, not bit for bit (the GPU test measures it
against the folded engine's).

Where it cannot serve the run (vLLM's CPU platform has no weight-only NVFP4 kernel; another format or MSE calibration;
an fp32 engine; the Megatron backend; MoE experts; the exact forward; tensor parallelism; merged adapters), "auto" keeps
the folded engine and "on" refuses, naming why, before anything loads.
Training and QAD runs serve the base packed; `qarl eval`, `parity` and `matrix` start engines of their own with the
base folded.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qarl.config import ConfigError, PolicyConfig, switch_mode
from qarl.distributed import world_size
from qarl.models.experts import config_has_experts
from qarl.quant import QuantFormat, resolve_format
from qarl.quant.formats import quantizer_settings

PACKED_FORMAT = "nvfp4_a16"  # the shipped format whose packed base vLLM serves (as ModelOpt's W4A16_NVFP4)
EXPORT_TARGET = "nvfp4_w4a16_modelopt"  # the export target the base is written with (bit for bit)


@dataclass(frozen=True)
class PackedBase:
    """The checkpoint a packed engine starts from (deleted once vLLM has loaded it), the policy's parameters it holds
    as loaded (never refitted: each packed layer's weight and bias, which vLLM reorders for its kernel), and the
    policy model they came from (the only one whose refits the engine takes)."""

    model_dir: Path
    packed: frozenset[str]
    source: weakref.ref = field(compare=False)

    def check_source(self, policy_model: object) -> None:
        if self.source() is not policy_model:
            raise ConfigError("this engine serves the packed base of another policy model "
                              "(policy.generation.packed_base): it takes refits only from the policy it was written "
                              "from; start an engine for this one")


def packed_base_blocker(cfg: PolicyConfig, fmt: QuantFormat | None, model_dir: str) -> str | None:
    """Why the engine cannot serve this policy's base packed (None: it can)."""
    if cfg.lora.mode != "qlora":
        return f"only a qlora base is frozen (policy.lora.mode={cfg.lora.mode})"
    if cfg.generation.qlora_adapters == "merged":
        return "the engine merges the adapters into its weights (policy.generation.qlora_adapters=merged)"
    if not cfg.lora.pack_base:
        return "the policy keeps its base unpacked (policy.lora.pack_base=false)"
    if fmt is None or quantizer_settings(fmt) != quantizer_settings(resolve_format(PACKED_FORMAT)):
        return (f"the base's format ({fmt.source if fmt else 'unquantized'}) is not NVFP4 W4A16 ({PACKED_FORMAT}), the "
                "format whose packed weights vLLM computes with directly")
    if fmt.calibration not in (None, "max"):
        return (f"{fmt.source} calibrates with {fmt.calibration}, whose static block scales the policy keeps "
                "unpacked")
    if not torch.cuda.is_available():
        return "vLLM's CPU platform has no weight-only NVFP4 kernel"
    if cfg.dtype not in ("bfloat16", "float16"):
        return f"vLLM's FP4 Marlin kernel computes in bf16 or fp16, not {cfg.dtype} (policy.dtype)"
    if cfg.backend != "hf":
        return f"the {cfg.backend} backend (its policy hands the engine folded weights)"
    if cfg.exact_forward:
        return "the exact forward runs its own kernels on folded weights (policy.exact_forward)"
    if config_has_experts(model_dir):
        return ("Mixture-of-Experts experts (the policy packs them, but a MoE engine takes its adapters by qarl's "
                "hooks, `vllm_lora.hooks_needed`, and the packed engine has run with vLLM's LoRA only)")
    if cfg.generation.tensor_parallel_size > 1 or world_size() > 1:
        return "tensor parallelism (the base is written whole, for one engine process)"
    return None


def serves_packed_base(cfg: PolicyConfig, fmt: QuantFormat | None, model_dir: str) -> bool:
    """`policy.generation.packed_base` decided for this policy: "auto" packs where it can, "on" packs or refuses."""
    mode = switch_mode(cfg.generation.packed_base, "policy.generation.packed_base")
    if mode == "off":
        return False
    blocker = packed_base_blocker(cfg, fmt, model_dir)
    if blocker and mode == "on":
        raise ConfigError(f"policy.generation.packed_base=on cannot serve this run: {blocker}. Use auto (the engine "
                          "then holds the base folded in the compute dtype) or off")
    return blocker is None
