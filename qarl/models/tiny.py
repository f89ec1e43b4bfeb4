"""The embedded default model: a tiny Qwen2 with a character-level tokenizer, made locally (and the same shape in
the other dense families, `embedded:tiny-<family>`).

No machine here reaches a model hub, so qarl builds its own model: deterministic from a seed and
saved as an ordinary Hugging Face directory that transformers and vLLM load like any other. Every
linear layer's input width is a multiple of 32, so NVFP4 (blocks of 16) and FP8 apply to all of them.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast,
                          Qwen2Config)

from qarl.distributed import exclusive
from qarl.files import give_umask_modes
from qarl.models.compiled import rms_norms

PAD, EOS = "<|pad|>", "<|endoftext|>"
# A small chat template, so the embedded run formats its prompts as a user's instruct model would:
# <|user|>40213><|end|><|assistant|>31204<|end|> (one token per role marker, the turn closed by <|end|>).
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
TOKENIZER_VERSION = 2  # 2: the chat template and its tokens
# Printable ASCII without the vertical tab and form feed: enough for arithmetic, GSM8K-like text and chat.
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of an embedded model. `vocab_size` leaves room past the ~100 tokens the tokenizer uses."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 128
    max_position_embeddings: int = 512


# Named sizes: "tiny" is the embedded default; "20m" is for refit timing on a model of realistic shape;
# "0.5b" has Qwen2.5-0.5B's layers (24 x hidden 896, MLP 4864, 14 query / 2 KV heads of 64), so a GPU
# run exercises real kernels at a real size without a hub: 358M parameters, since its vocabulary is
# the embedded tokenizer's 128 tokens instead of Qwen's 151936.
SPECS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "20m": TinyModelSpec(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4,
    ),
    "0.5b": TinyModelSpec(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2,
    ),
    # each family's attention at its real shape (`REALISTIC_ATTENTION`) with real-like activations (`plant_activations`)
    "realistic": TinyModelSpec(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    ),
}
# The realistic size's attention per family: (hidden size, query heads, key/value heads, head_dim). head_dim as a
# released model of the family has it: Gemma 3's 256 with one key/value head (270M, 1B), 128 elsewhere (Qwen3, Llama 3
# 8B, Mistral 7B, Qwen2.5 7B, Phi-3 medium); attention kernels round by shape, and head_dim 32 hid what 256 and 128
# show. Attention 1,024 wide (512 for Qwen2, whose vLLM model takes head_dim as hidden / heads), as Gemma 3 1B's: a
# last-bit difference flips a rounding in one element of a million or so, and a real model has that many.
REALISTIC_ATTENTION: dict[str, tuple[int, int, int, int]] = {
    "qwen2": (512, 4, 1, 128), "qwen3": (256, 8, 2, 128), "llama3": (256, 8, 2, 128), "mistral": (256, 8, 2, 128),
    "gemma3": (256, 4, 1, 256), "phi3": (256, 8, 2, 128), "qwen3moe": (256, 8, 2, 128), "qwen2moe": (512, 4, 1, 128),
}
REALISTIC_VERSION = 1  # of `plant_activations`: a cached realistic model made by another is made again
SLIDING_WINDOWS = {"realistic": 16}  # a sliding-window layer's window (other sizes: 64); the realistic one is shorter
# than the embedded prompts, so that their tokens attend through it


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable ASCII character is one token, plus the chat template's markers."""
    vocab = {PAD: 0, EOS: 1}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=None, unk_token=EOS,
        model_max_length=SPECS["tiny"].max_position_embeddings,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _qwen2(common: dict, head_dim: int, window: int) -> PretrainedConfig:
    return Qwen2Config(**common, rope_theta=10000.0)


def _qwen3(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # q/k norms
    from transformers import Qwen3Config

    return Qwen3Config(**common, head_dim=head_dim, rope_theta=10000.0)


def _llama3(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # Llama 3.1/3.2's scaled RoPE
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaConfig(**common, head_dim=head_dim, rope_parameters=rope)


def _mistral(common: dict, head_dim: int, window: int) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**common, head_dim=head_dim, rope_theta=10000.0, sliding_window=None)


def _gemma3(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # scaled embeddings, 4 norms a layer,
    from transformers import Gemma3TextConfig  # sliding layers (the last layer global)

    layers = common["num_hidden_layers"]
    return Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
                            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])


def _phi3(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # q/k/v and gate/up fused in the checkpoint
    from transformers import Phi3Config

    return Phi3Config(**common, head_dim=head_dim, rope_theta=10000.0)


def _qwen3moe(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # Mixture-of-Experts: 8 experts, 2 a token
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**common, head_dim=head_dim, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=common["intermediate_size"] // 4, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])


def _qwen2moe(common: dict, head_dim: int, window: int) -> PretrainedConfig:  # MoE beside a gated shared expert
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**common, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=common["intermediate_size"] // 4,
                          shared_expert_intermediate_size=common["intermediate_size"] // 2, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])


# The families an embedded model comes in (`embedded:tiny-<family>`; plain `embedded:tiny` is qwen2), each a
# config of one family's architecture at the tiny shape; the weights are random, drawn from the seed.
FAMILIES: dict[str, Callable[[dict, int, int], PretrainedConfig]] = {
    "qwen2": _qwen2, "qwen3": _qwen3, "llama3": _llama3, "mistral": _mistral, "gemma3": _gemma3, "phi3": _phi3,
    "qwen3moe": _qwen3moe, "qwen2moe": _qwen2moe,
}


def family_spec(size: str, family: str) -> tuple[TinyModelSpec, int]:
    """The shape of the embedded model of `family` at `size`, and its head_dim."""
    spec = SPECS[size]
    if size != "realistic":
        return spec, spec.hidden_size // spec.num_attention_heads
    hidden, heads, kv_heads, head_dim = REALISTIC_ATTENTION[family]
    return replace(spec, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads), head_dim


def build_model(size: str, tokenizer: PreTrainedTokenizerFast, seed: int, family: str = "qwen2") -> PreTrainedModel:
    """A randomly initialised model of `family` at `size` with tied embeddings, deterministic from `seed` (at the
    realistic size, with real-like activations planted)."""
    spec, head_dim = family_spec(size, family)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens; vocab_size {spec.vocab_size} is too small")
    common = dict(**asdict(spec), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    config = FAMILIES[family](common, head_dim, SLIDING_WINDOWS.get(size, 64))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if size == "realistic":
        plant_activations(model, seed, tokenizer.convert_tokens_to_ids(CHAT_TOKENS), offset_norms=family == "gemma3")
    return model


# What `plant_activations` aims at, as trained models have them: a few residual channels carrying OUTLIER_SIZE in every
# token, and MASSIVE_SIZE in the tokens that open a chat turn (the attention sinks); attention logits and output logits
# of these spreads (standard deviation over a row).
OUTLIER_CHANNELS, OUTLIER_SIZE, MASSIVE_SIZE = 4, 40.0, 400.0
ATTENTION_LOGIT_STD, OUTPUT_LOGIT_STD = 4.0, 3.0


@torch.no_grad()
def plant_activations(model: PreTrainedModel, seed: int, sinks: list[int], offset_norms: bool) -> None:
    """Give a randomly initialised model the activations a trained one has, in place, deterministic from `seed`.
    Random weights (transformers' init: std 0.02, unit norms) compute near-uniform attention and next-token
    distributions over small, even activations; a trained model's are peaked, over outliers. Here:
      * every linear layer (and expert) is drawn with std 1/sqrt(fan-in), so activations keep their scale;
      * OUTLIER_CHANNELS residual channels carry OUTLIER_SIZE in every token, and one of them MASSIVE_SIZE in the
        tokens `sinks` (LLMs' outlier channels and massive activations; set in the embedding, through its scale), so
        each norm divides by a sum its outliers dominate;
      * every RMSNorm's gains are spread log-normally, two of its channels 4-8 times the rest (`offset_norms`: the
        weight is gain - 1, Gemma's (1 + w) norms);
      * each layer's attention logits spread ATTENTION_LOGIT_STD (peaked softmax rows): its q/k norms' gains, or its
        input norm's, scaled to it layer by layer on a random prompt;
      * the final norm passes none of the outlier channels (the tied head would otherwise predict the sinks) and its
        gains spread the output logits OUTPUT_LOGIT_STD (1.5-3 nats of entropy a token)."""
    generator = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    for name, weight in model.named_parameters():  # linear layers, and a MoE layer's experts [experts, out, in]
        if name.endswith("weight") and weight.dim() == 2 and "embed" not in name or "experts" in name:
            weight.copy_(randn(*weight.shape) / weight.shape[-1] ** 0.5)
    embeddings = model.get_input_embeddings()
    table, scale = embeddings.weight, getattr(embeddings, "scalar_embed_scale", 1.0)  # (Gemma: sqrt(hidden))
    channels = torch.randperm(table.shape[1], generator=generator)[:OUTLIER_CHANNELS]
    signs = torch.where(randn(OUTLIER_CHANNELS) > 0, 1.0, -1.0)
    table[:, channels] = signs * OUTLIER_SIZE / scale
    table[sinks, channels[0]] = signs[0] * MASSIVE_SIZE / scale
    offset = 1.0 if offset_norms else 0.0
    for norm in rms_norms(model):
        gains = (randn(norm.weight.shape[0]) * 0.3).exp()
        gains[torch.randperm(gains.shape[0], generator=generator)[:2]] *= 4.0 + 4.0 * torch.rand(2, generator=generator)
        norm.weight.copy_(gains - offset)
    prompt = torch.randint(0, table.shape[0], (2, 96), generator=generator)
    prompt[:, 0] = sinks[0]  # a turn opens it
    for layer in model.get_decoder().layers:
        attention = layer.self_attn
        spread = _attention_logit_std(model, prompt, attention)
        factor = ATTENTION_LOGIT_STD / spread
        scaled = ([attention.q_norm, attention.k_norm] if hasattr(attention, "q_norm") else [layer.input_layernorm])
        for norm in scaled:  # logits grow with the product of q's and k's scales: each q/k norm takes a square root
            _scale_gains(norm, factor ** 0.5, offset)
    final = model.get_decoder().norm
    final.weight[channels] = -offset  # gain 0: the (tied) head reads the tokens' channels, not the outliers
    _scale_gains(final, OUTPUT_LOGIT_STD / model(input_ids=prompt).logits.std(-1).mean().item(), offset)


def _scale_gains(norm: nn.Module, factor: float, offset: float) -> None:
    norm.weight.copy_((norm.weight + offset) * factor - offset)


def _attention_logit_std(model: PreTrainedModel, prompt: torch.Tensor, attention: nn.Module) -> float:
    """The spread of `attention`'s logits (scale x q.k over the causal pairs) as `model` computes `prompt`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    spreads = []

    def probe(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module is attention:
            keys = repeat_kv(key, query.shape[1] // key.shape[1])
            logits = query @ keys.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
            spreads.append(logits[..., torch.ones(logits.shape[-2:], dtype=torch.bool).tril()].std().item())
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    used = model.config._attn_implementation
    model.set_attn_implementation(PROBE)
    try:
        model(input_ids=prompt)
    finally:
        model.set_attn_implementation(used)
    return spreads[0]


PROBE = "qarl_logit_probe"  # the attention function `_attention_logit_std` registers with transformers


def make_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, family: str = "qwen2") -> Path:
    """Write the embedded model of `family` and the tokenizer to `out_dir` (skipped if an identical one is there)."""
    if size not in SPECS:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(SPECS)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown embedded model family {family!r}; choose one of {sorted(FAMILIES)}")
    out = Path(out_dir)
    marker = out / "qarl_embedded.json"
    spec = asdict(family_spec(size, family)[0])
    identity = {"size": size, "seed": seed, "spec": spec, "tokenizer": TOKENIZER_VERSION}
    if family != "qwen2":  # the Qwen2 models' identity (and every warm start keyed on it) as before families
        identity["family"] = family
    if size == "realistic":
        identity["activations"] = REALISTIC_VERSION
    with exclusive(out.with_name(out.name + ".lock")):
        if marker.exists() and json.loads(marker.read_text()) == identity:
            return out
        tokenizer = build_tokenizer()
        model = build_model(size, tokenizer, seed, family)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "qarl_embedded.json").write_text(json.dumps(identity))
        give_umask_modes(tmp)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
    return out
