"""Mixture-of-Experts layers as transformers 5 holds them and as checkpoints (and vLLM's loaders) name them.

transformers keeps a layer's experts fused: `experts.gate_up_proj` [experts, 2 x intermediate, hidden] (each
expert's gate rows, then its up rows) and `experts.down_proj` [experts, hidden, intermediate]. A checkpoint names
each expert's matrices apart (`experts.{e}.gate_proj.weight`, ...), and vLLM's FusedMoE loaders take those names,
so the rollout engine and exports get them from `expert_weights`. The names are the family's
(`CHECKPOINT_NAMES`); a MoE family not listed there is refused by name (`check_experts`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from qarl.config import ConfigError

# model_type -> each expert's (gate, up, down) weight names in the family's checkpoints
CHECKPOINT_NAMES: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
FUSED = ("gate_up_proj", "down_proj")  # a fused experts module's 3-D parameters


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused experts module (gated: gate_up_proj and down_proj, both 3-D parameters)."""
    params = module._parameters
    return all(params.get(name) is not None and params[name].dim() == 3 for name in FUSED)


def has_experts(model: nn.Module) -> bool:
    return any(is_fused_experts(m) for m in model.modules())


def config_has_experts(model_dir: str | Path) -> bool:
    """Whether a model directory's config.json describes Mixture-of-Experts layers (read without transformers)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config = config.get("text_config", config)
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def check_experts(model_type: str | None, model: nn.Module) -> None:
    """A model with fused experts must be of a family whose checkpoint names qarl knows."""
    if has_experts(model) and model_type not in CHECKPOINT_NAMES:
        raise ConfigError(f"model_type {model_type!r} has Mixture-of-Experts layers in a layout qarl has not mapped to "
                          f"its checkpoint names; supported MoE families: {sorted(CHECKPOINT_NAMES)}")


def expert_weights(prefix: str, fused: str, tensor: torch.Tensor, model_type: str,
                   fold: list | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts' matrices in one fused parameter (`fused`: "gate_up_proj", [experts, 2 x intermediate,
    hidden], or "down_proj", [experts, hidden, intermediate]) under their checkpoint names (`prefix`: the experts
    module's name and a dot); `fold`: a function per expert applied to its whole slice first (its weight quantizer,
    as the quantized forward applies it)."""
    gate_name, up_name, down_name = CHECKPOINT_NAMES[model_type]
    for expert, matrix in enumerate(tensor):
        if fold is not None:
            matrix = fold[expert](matrix)
        if fused == "down_proj":
            yield f"{prefix}{expert}.{down_name}.weight", matrix
        else:
            gate, up = matrix.chunk(2, dim=0)
            yield f"{prefix}{expert}.{gate_name}.weight", gate
            yield f"{prefix}{expert}.{up_name}.weight", up


def fuse_expert_weights(weights: Mapping[str, torch.Tensor], model_type: str | None) -> dict[str, torch.Tensor]:
    """The inverse of `expert_weights`: each experts module's per-expert checkpoint names stacked back into its fused
    `gate_up_proj` and `down_proj` (as a transformers model's state dict holds them); other names unchanged."""
    if model_type not in CHECKPOINT_NAMES:
        return dict(weights)
    gate_name, up_name, down_name = CHECKPOINT_NAMES[model_type]
    pattern = re.compile(rf"(.*\.experts\.)(\d+)\.({gate_name}|{up_name}|{down_name})\.weight")
    out, parts = {}, {}
    for name, tensor in weights.items():
        found = pattern.fullmatch(name)
        if found is None:
            out[name] = tensor
        else:
            parts.setdefault(found[1], {})[(int(found[2]), found[3])] = tensor
    for prefix, matrices in parts.items():
        experts = range(1 + max(e for e, _ in matrices))
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat((matrices[e, gate_name], matrices[e, up_name]))
                                                    for e in experts])
        out[prefix + "down_proj"] = torch.stack([matrices[e, down_name] for e in experts])
    return out
