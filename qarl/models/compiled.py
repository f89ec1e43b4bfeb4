"""Elementwise layers as fused kernels: `policy.compile_norms`, `policy.compile_mlp`, or whole decoder layers,
`policy.compile_layers` (the head's scoring, `policy.compile_scores`, is compiled in qarl/scoring.py).

An eager RMSNorm runs about seven kernels a pass (the fp32 upcast, square, mean, rsqrt, two products, the cast back)
and a gated MLP's activation two (act(gate), its product with up) on tensors three times the hidden width, with as
many again in the backward, each reading and writing the whole activation; between the matmuls of a decoder layer
these are much of the update's time. torch.compile fuses each into a kernel or two. Only these are compiled: the
quantized linear layers (ModelOpt's quantizers, qarl's weight cache) stay eager, so nothing about quantization
changes. Dynamic shapes: one compiled graph for every batch and sequence length (and one for a single row).
A model with compiled layers deep-copies (the KL reference) but does not pickle; qarl saves state dicts, which these
leave as they were.

`compile_layers` compiles each decoder layer whole (regional compilation: the same compiled code serves every layer),
so the rotary embedding, the residual additions and the reshapes around attention fuse as well. A quantized linear
layer is traced only where it is a plain matmul of a weight that holds its quantized value (mixed precision,
`qarl.quant.mark_plain_linears`); any other runs eagerly, as does the varlen attention on a GPU, and the layer then
runs as a few graphs split at them; the quantizers are the same ops as above.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from qarl.config import ConfigError
from qarl.models.experts import has_experts
from qarl.torch_compat import allow_recompiles

RECOMPILE_LIMIT = 32  # graphs a compiled decoder layer may keep: grad x train/eval x padded/packed x its quantized
# matmuls traced or eager is 16, with room (beyond it dynamo runs the layer eagerly: the same numbers, slower)

# transformers' MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x))
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "Gemma3MLP")


def rms_norms(model: nn.Module) -> list[nn.Module]:
    """The model's RMSNorm layers (transformers names each family's `<Family>RMSNorm`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def compile_norms(model: nn.Module) -> int:
    """Compile each RMSNorm layer of `model` in place; returns how many."""
    norms = rms_norms(model)
    for norm in norms:
        norm.compile(dynamic=True)
    return len(norms)


def gated_mlps(model: nn.Module) -> list[nn.Module]:
    """The model's gated MLPs of the classes in GATED_MLPS."""
    return [m for m in model.modules() if type(m).__name__ in GATED_MLPS]


def _fused_gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's forward with act(gate) * up as one compiled function (bound to each MLP, so a deep copy of
    the model, the KL reference, binds it to its own layers)."""
    return self.down_proj(self.qarl_gated_activation(self.gate_proj(x), self.up_proj(x)))


def check_gated_mlps(model: nn.Module) -> list[nn.Module]:
    """The model's gated MLPs; a model with none (its family's MLP is not one whose forward this knows) refused.
    Works on the architecture built on the meta device, before the weights load."""
    mlps = gated_mlps(model)
    if not mlps:
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("MLP")})
        raise ConfigError(f"policy.compile_mlp fuses the gated MLPs of {', '.join(GATED_MLPS)}; this model has "
                          f"{', '.join(found) or 'none of them'}. Set policy.compile_mlp=false.")
    return mlps


def compile_mlp(model: nn.Module) -> int:
    """Fuse each gated MLP's activation and product in place (the projections stay eager); returns how many."""
    mlps = check_gated_mlps(model)
    compiled: dict[str, object] = {}  # one compiled function per activation: one graph for every layer
    for mlp in mlps:
        act = mlp.act_fn
        key = repr(act)
        if key not in compiled:
            compiled[key] = torch.compile(lambda gate, up, act=act: act(gate) * up, dynamic=True)
        mlp.qarl_gated_activation = compiled[key]
        mlp.forward = types.MethodType(_fused_gated_forward, mlp)
    return len(mlps)


def check_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The layers `compile_layers` compiles (`get_decoder().layers`); a model without a stack of dense decoder layers
    refused. Works on the architecture built on the meta device, before the weights load."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if get_decoder is not None else None
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ConfigError(f"policy.compile_layers compiles a transformers model's decoder layers; "
                          f"{type(model).__name__} has no `get_decoder().layers`: set policy.compile_layers=false")
    if has_experts(model):
        raise ConfigError("policy.compile_layers compiles dense decoder layers; this model's layers route tokens to "
                          "experts (a shape that changes with every batch): set policy.compile_layers=false and use "
                          "policy.compile_norms")
    return layers


def compile_layers(layers: nn.ModuleList) -> int:
    """Compile each of the decoder `layers` (`check_decoder_layers`) in place; returns how many. The caller has
    checked that the compiler traces no quantized layer (the HF backend: `qarl.quant.traced_quantized_modules`)."""
    allow_recompiles(RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
