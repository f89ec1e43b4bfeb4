"""The policy's quantized fast paths, the same bits as ModelOpt's own: one fake quantization of each weight per
change (`weight_cache`) and quantized layers' forwards without ModelOpt's per-call module machinery
(`lean_forward`). Optional: `policy.quant_weight_cache=false` runs ModelOpt's path unchanged."""
