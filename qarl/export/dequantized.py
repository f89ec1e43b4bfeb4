"""Export the weights a fake-quant policy computes with, dequantized, as a plain Hugging Face model.

For those who re-quantize later with their own tool: each quantized weight is its fake-quantized value
Q(W) (the fold the rollout engine loads), and a qlora adapter is merged on top of it, W' = Q(W) + s B A,
in the adapter's precision and rounded once to `dtype`. An adapter is never merged into packed 4-bit
weights: the merge of a qlora policy is into its dequantized base. Merged-mode LoRA and fully trained
policies need no merge (their fold already holds Q(W + s B A) or Q(W)).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from qarl.config import ConfigError
from qarl.dir_lock import check_out_dir
from qarl.files import give_umask_modes


@torch.no_grad()
def export_dequantized(policy, out_dir: str | Path, dtype: str = "bfloat16", overwrite: bool = False) -> dict[str, Any]:
    """Write `policy` (a qarl Policy) as an unquantized `dtype` model directory; returns a summary."""
    from transformers import AutoModelForCausalLM

    from qarl.lora import lora_layers
    from qarl.models.experts import fuse_expert_weights
    from qarl.config import DTYPES
    from qarl.quant import folded_weights

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {DTYPES}")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    weights = dict(folded_weights(policy.model))
    merged = 0
    for name, layer in lora_layers(policy.model):
        if layer.serves_adapter:
            key = f"{name}.weight"
            delta = (layer.lora_B @ layer.lora_A) * layer.lora_scale
            weights[key] = (weights[key].to(layer.lora_A.dtype) + delta).to(weights[key].dtype)
            merged += 1
    weights = fuse_expert_weights(weights, policy.model.config.model_type)  # (the fold names each expert apart)
    model = AutoModelForCausalLM.from_config(policy.model.config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in weights.items()},
                                                strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(f"the policy's weights do not fill a plain {type(model).__name__}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    policy.tokenizer.save_pretrained(tmp)
    give_umask_modes(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return {"out_dir": str(out_dir), "dtype": dtype, "quantized_weights_dequantized": policy.format is not None,
            "adapters_merged": merged,
            "bytes": sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))}
