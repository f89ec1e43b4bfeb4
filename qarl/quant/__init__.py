"""The ModelOpt seam: quantization formats, the policy's quantizers, and qarl's fake-quant kernels.

Layers, each importing only those below it: `modelopt_compat` (every private ModelOpt name) and `formats` ->
`kernels` (CPU port, GPU kernels) -> `ops` (the input fake-quant op both sides call) -> `mixins` (class changes,
change tracking) -> `fastpath` (weight cache, lean forward) -> `quantize` (insert, calibrate, fused amax, fold,
state) -> `rollout_view`.
"""

from qarl.quant.fastpath.lean_forward import linear_weight, mark_plain_linears, traced_quantized_modules
from qarl.quant.formats import QuantFormat, check_generation_matches, resolve_format
from qarl.quant.modelopt_compat import swaps_functions_in_forward
from qarl.quant.packed import pack_frozen_weights
from qarl.quant.quantize import (
    FUSED_SIBLINGS,
    calibrate,
    check_trainable_format,
    folded_weights,
    load_quantizer_state,
    quantize_policy,
    quantizer_state,
    w4a4_share,
)

__all__ = [
    "FUSED_SIBLINGS",
    "QuantFormat",
    "calibrate",
    "check_generation_matches",
    "check_trainable_format",
    "folded_weights",
    "linear_weight",
    "load_quantizer_state",
    "mark_plain_linears",
    "pack_frozen_weights",
    "quantize_policy",
    "quantizer_state",
    "resolve_format",
    "swaps_functions_in_forward",
    "traced_quantized_modules",
    "w4a4_share",
]
