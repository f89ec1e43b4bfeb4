"""Hugging Face <-> Megatron-core weights for the Llama family (Llama, Qwen2, Qwen3) and Qwen2/3-MoE, at any TP.

Megatron's GPT layer fuses what Hugging Face keeps apart, and shards across tensor-parallel (TP)
ranks what one GPU cannot hold:

  linear_qkv   q/k/v rows grouped per query group: [q heads of group g; k_g; v_g] for g = 0..G-1;
               TP rank r holds the groups r*G/tp .. (r+1)*G/tp (column parallel: rows split)
  linear_proj  o_proj, row parallel (input columns split)
  linear_fc1   [gate; up]; TP rank r holds [gate_r; up_r] (Megatron halves its local output for SwiGLU)
  linear_fc2   down_proj, row parallel
  embeddings and output layer: vocabulary rows split; norms (and Qwen3's q/k norms): on every rank
  Mixture-of-Experts (Qwen2/3-MoE, expert parallel size 1): the router (`mlp.gate`) on every rank; each expert
               `mlp.experts.local_experts.j.linear_fc1/fc2` is HF's `mlp.experts.j.*_proj`, sharded as the dense MLP;
               Qwen2-MoE's shared expert `mlp.shared_experts.linear_fc1/fc2` too, its gate on every rank

Pure torch, no Megatron import: the converter is tested round trip on CPU, and the same functions
load a checkpoint into a Megatron model (`shard`), and gather a trained one back into Hugging Face
names for refit, checkpoints and export (`unshard`), one tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qarl.config import ConfigError
from qarl.models.experts import FUSED as FUSED_EXPERTS

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class GPTShape:
    """What Megatron needs to know of a Hugging Face Llama-family config."""

    family: str
    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    norm_eps: float
    max_positions: int
    experts: int = 0  # routed experts of every layer's Mixture-of-Experts MLP; 0: a dense MLP
    topk: int = 0  # experts a token
    expert_ffn: int = 0  # each expert's MLP width (moe_intermediate_size)
    norm_topk: bool = True  # the top-k routing weights renormalized to sum to 1 (norm_topk_prob)
    shared_ffn: int = 0  # Qwen2-MoE's shared expert's MLP width (its output gated by a sigmoid); 0: none

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def mlp_width(self) -> int:
        """The width TP splits of each layer's MLP: an expert's for a Mixture-of-Experts model."""
        return self.expert_ffn if self.experts else self.ffn


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def gpt_shape(config: dict) -> GPTShape:
    """The GPT shape of a Hugging Face config, or a ConfigError naming what the converter does not handle."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"the Megatron backend converts the model families {FAMILIES}; this model is "
                          f"{family!r} ({config.get('architectures')}). Train it with the Hugging Face backend.")
    unsupported = []
    for key in ("rope_scaling", "rope_parameters"):  # transformers < 5 and >= 5 spell rotary scaling differently
        rope = config.get(key) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            unsupported.append(f"{key}={rope}")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']}")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if family in ("llama", "qwen3", "qwen3_moe") and config.get("attention_bias"):
        unsupported.append("attention_bias=true (Megatron's GPT layer has a q/k/v bias but no o_proj bias)")
    if config.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true")
    if family in MOE_FAMILIES:  # Megatron's MoE layer spec puts one kind of MLP in every layer
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            unsupported.append(f"dense MLP layers among the MoE ones (mlp_only_layers={config.get('mlp_only_layers')}, "
                               f"decoder_sparse_step={config.get('decoder_sparse_step')})")
    if unsupported:
        raise ConfigError(f"the Megatron backend cannot build this {family} model: {'; '.join(unsupported)}. "
                          "Train it with the Hugging Face backend.")
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    if heads % groups:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    qk_norm = family in ("qwen3", "qwen3_moe")
    moe = {}
    if family in MOE_FAMILIES:  # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
        moe = dict(experts=config.get("num_experts") or config["num_local_experts"],
                   topk=config["num_experts_per_tok"], expert_ffn=config["moe_intermediate_size"],
                   norm_topk=bool(config.get("norm_topk_prob")),
                   shared_ffn=config.get("shared_expert_intermediate_size") or 0)
    return GPTShape(
        family=family,
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=heads,
        groups=groups,
        head_dim=config.get("head_dim") or (128 if qk_norm else config["hidden_size"] // heads),  # HF defaults
        ffn=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
        qk_norm=qk_norm,
        rope_theta=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_positions=config.get("max_position_embeddings", 4096),
        **moe,
    )


def check_parallel(shape: GPTShape, tp: int, block_size: int | None = None) -> None:
    """TP must divide what Megatron splits, and a quantization block must not straddle two ranks' shards
    of a row-parallel layer (o_proj, down_proj: their input columns are split)."""
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp}; it must be >= 1")
    splits = {"attention heads": shape.heads, "query groups (key/value heads)": shape.groups,
              "vocabulary size": shape.vocab,
              ("expert MLP width (moe_intermediate_size)" if shape.experts else "MLP width (intermediate_size)"):
                  shape.mlp_width, "shared expert MLP width (shared_expert_intermediate_size)": shape.shared_ffn}
    bad = [f"{what} {n}" for what, n in splits.items() if n % tp]
    if bad:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the model's {', '.join(bad)}; "
                          "choose a TP size that divides all of them")
    if block_size:
        widths = {"o_proj": shape.heads * shape.head_dim // tp, "down_proj": shape.mlp_width // tp,
                  "shared_expert.down_proj": shape.shared_ffn // tp}
        bad = [f"{name} (input width per rank {w})" for name, w in widths.items() if w % block_size]
        if bad:
            raise ConfigError(f"at tensor_parallel_size={tp} the quantization block size {block_size} does not divide "
                              f"the sharded input width of {', '.join(bad)}: blocks would straddle two ranks. Use a "
                              "smaller TP size.")


# Megatron tensor (per decoder layer, or global) -> its Hugging Face tensors and how TP splits it.
LAYER_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "columns"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "columns"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
    "mlp.shared_experts.linear_fc1.weight": (("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                                             "gate_up"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "columns"),
    "mlp.shared_experts.gate.weight": (("mlp.shared_expert_gate.weight",), "replicated"),  # Linear(hidden, 1)
}
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
# Megatron's local experts (SequentialMLP): expert j's linear_fc1/fc2 are HF's expert j's, named and split as the dense
# MLP's; their quantizers are the fused experts module's that transformers and ModelOpt give Hugging Face models
# (qarl/models/experts.py): an input quantizer all experts share, a weight quantizer each.
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])")  # expert j's linear layer
EXPERT_FUSED = dict(zip(("linear_fc1", "linear_fc2"), FUSED_EXPERTS))  # -> transformers' fused expert parameter
GLOBAL_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "rows"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "replicated"),
    "output_layer.weight": (("lm_head.weight",), "rows"),
}


def megatron_names(shape: GPTShape) -> list[str]:
    """Every Megatron parameter of the model, in the order the model holds them."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(shape.layers):
        for suffix in LAYER_RULES:
            if suffix.endswith("linear_qkv.bias") and not shape.qkv_bias:
                continue
            if "_layernorm" in suffix and suffix.startswith("self_attention.") and not shape.qk_norm:
                continue
            if (suffix in DENSE_MLP and shape.experts) or (suffix == "mlp.router.weight" and not shape.experts):
                continue
            if suffix.startswith("mlp.shared_experts.") and not shape.shared_ffn:
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
        names += [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.{fc}.weight"
                  for j in range(shape.experts) for fc in EXPERT_FUSED]
    names.append("decoder.final_layernorm.weight")
    if not shape.tied:
        names.append("output_layer.weight")
    return names


def hf_sources(name: str) -> tuple[tuple[str, ...], str]:
    """(Hugging Face names, split kind) of a Megatron parameter name."""
    if name in GLOBAL_RULES:
        return GLOBAL_RULES[name]
    prefix, _, rest = name.partition(".layers.")
    index, _, suffix = rest.partition(".")
    expert = EXPERT.fullmatch(suffix.removesuffix(".weight")) if prefix == "decoder" else None
    if expert is not None and suffix.endswith(".weight"):  # expert j's layer is the dense MLP's, under mlp.experts.j
        hf_suffixes, kind = LAYER_RULES[f"mlp.{expert[2]}.weight"]
        experts = f"model.layers.{index}.mlp.experts.{expert[1]}."
        return tuple(experts + s.removeprefix("mlp.") for s in hf_suffixes), kind
    if prefix != "decoder" or suffix not in LAYER_RULES:
        raise KeyError(f"{name} is not a parameter of a Llama-family Megatron GPT model")
    hf_suffixes, kind = LAYER_RULES[suffix]
    return tuple(f"model.layers.{index}.{s}" for s in hf_suffixes), kind


def hf_modules(megatron_module: str) -> list[str]:
    """The Hugging Face linear layers a Megatron linear layer stands for: decoder.layers.3.mlp.linear_fc1 ->
    [model.layers.3.mlp.gate_proj, model.layers.3.mlp.up_proj] (vLLM fuses them back into gate_up_proj)."""
    names, _ = hf_sources(f"{megatron_module}.weight")
    return [n.removesuffix(".weight") for n in names]


def hf_quantizers(megatron_module: str, role: str) -> list[str]:
    """The Hugging Face quantizers (module names) that quantizer `role` ("input_quantizer", ...) of a Megatron linear
    layer stands for: each part's of a fused layer (linear_qkv's input_quantizer -> q/k/v_proj.input_quantizer); of
    local expert j's linear_fc1, the fused experts module's: `mlp.experts.gate_up_proj_input_quantizer`, which every
    expert shares (ModelOpt max-reduces Megatron's experts' input amax into one), and
    `mlp.experts.gate_up_proj_weight_quantizers.j`."""
    prefix, _, rest = megatron_module.partition(".layers.")
    index, _, suffix = rest.partition(".")
    expert = EXPERT.fullmatch(suffix) if prefix == "decoder" else None
    if expert is None:
        return [f"{m}.{role}" for m in hf_modules(megatron_module)]
    kind = role.removesuffix("_quantizer")
    own = f"_{kind}_quantizers.{expert[1]}" if kind == "weight" else f"_{kind}_quantizer"
    return [f"model.layers.{index}.mlp.experts.{EXPERT_FUSED[expert[2]]}{own}"]


def _qkv_parts(shape: GPTShape) -> tuple[int, int]:
    """Rows per query group: q rows, k (= v) rows."""
    return shape.heads_per_group * shape.head_dim, shape.head_dim


def shard(name: str, hf: list[torch.Tensor], shape: GPTShape, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of Megatron parameter `name`, from its Hugging Face tensors (`hf_sources` order)."""
    _, kind = hf_sources(name)
    if kind == "replicated":
        return hf[0]
    if kind == "rows":
        return hf[0].chunk(tp, dim=0)[rank]
    if kind == "columns":
        return hf[0].chunk(tp, dim=1)[rank]
    if kind == "gate_up":
        return torch.cat([t.chunk(tp, dim=0)[rank] for t in hf])
    q_rows, kv_rows = _qkv_parts(shape)
    q, k, v = (t.reshape(shape.groups, -1, *t.shape[1:]) for t in hf)  # [groups, rows per group, (in)]
    fused = torch.cat([q, k, v], dim=1)  # [groups, q_rows + 2 kv_rows, (in)]
    assert fused.shape[1] == q_rows + 2 * kv_rows
    return fused.chunk(tp, dim=0)[rank].reshape(-1, *hf[0].shape[1:])


def unshard(name: str, shards: list[torch.Tensor], shape: GPTShape) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of Megatron parameter `name`, from all TP ranks' shards (rank order)."""
    hf_names, kind = hf_sources(name)
    if kind == "replicated":
        return [(hf_names[0], shards[0])]
    if kind == "rows":
        return [(hf_names[0], torch.cat(shards, dim=0))]
    if kind == "columns":
        return [(hf_names[0], torch.cat(shards, dim=1))]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(hf_names[i], torch.cat([h[i] for h in halves], dim=0)) for i in range(2)]
    q_rows, kv_rows = _qkv_parts(shape)
    fused = torch.cat(shards, dim=0).reshape(shape.groups, q_rows + 2 * kv_rows, *shards[0].shape[1:])
    parts = fused.split([q_rows, kv_rows, kv_rows], dim=1)
    return [(n, p.reshape(-1, *shards[0].shape[1:])) for n, p in zip(hf_names, parts)]


def megatron_shards(shape: GPTShape, tp: int, rank: int,
                    read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `rank`'s Megatron state, reading the Hugging Face tensors it needs through `read`, one
    Megatron parameter at a time (a checkpoint never needs to be in memory whole)."""
    for name in megatron_names(shape):
        hf_names, _ = hf_sources(name)
        yield name, shard(name, [read(n) for n in hf_names], shape, tp, rank).contiguous()
