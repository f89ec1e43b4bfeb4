"""The ModelOpt seam: quantization formats, the policy's quantizers, and the NVFP4 CPU kernel."""

from qarl.quant.formats import QuantFormat, check_generation_matches, resolve_format
from qarl.quant.quantize import (
    FUSED_SIBLINGS,
    folded_weights,
    load_quantizer_state,
    quantize_policy,
    quantizer_state,
)

__all__ = [
    "FUSED_SIBLINGS",
    "QuantFormat",
    "check_generation_matches",
    "folded_weights",
    "load_quantizer_state",
    "quantize_policy",
    "quantizer_state",
    "resolve_format",
]
