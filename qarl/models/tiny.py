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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast,
                          Qwen2Config)

from qarl.distributed import exclusive
from qarl.files import give_umask_modes

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
}


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


def _qwen2(common: dict, head_dim: int) -> PretrainedConfig:
    return Qwen2Config(**common, rope_theta=10000.0)


def _qwen3(common: dict, head_dim: int) -> PretrainedConfig:  # q/k norms
    from transformers import Qwen3Config

    return Qwen3Config(**common, head_dim=head_dim, rope_theta=10000.0)


def _llama3(common: dict, head_dim: int) -> PretrainedConfig:  # Llama 3.1/3.2's scaled RoPE
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaConfig(**common, rope_parameters=rope)


def _mistral(common: dict, head_dim: int) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**common, head_dim=head_dim, rope_theta=10000.0, sliding_window=None)


def _gemma3(common: dict, head_dim: int) -> PretrainedConfig:  # scaled embeddings, 4 norms a layer, sliding layers
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64,
                            layer_types=["sliding_attention", "full_attention"])


def _phi3(common: dict, head_dim: int) -> PretrainedConfig:  # q/k/v and gate/up fused in the checkpoint
    from transformers import Phi3Config

    return Phi3Config(**common, rope_theta=10000.0)


def _qwen3moe(common: dict, head_dim: int) -> PretrainedConfig:  # Mixture-of-Experts: 8 experts, 2 a token
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**common, head_dim=head_dim, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=common["intermediate_size"] // 4, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])


def _qwen2moe(common: dict, head_dim: int) -> PretrainedConfig:  # Mixture-of-Experts beside a gated shared expert
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**common, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=common["intermediate_size"] // 4,
                          shared_expert_intermediate_size=common["intermediate_size"] // 2, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])


# The families an embedded model comes in (`embedded:tiny-<family>`; plain `embedded:tiny` is qwen2), each a
# config of one family's architecture at the tiny shape; the weights are random, drawn from the seed.
FAMILIES: dict[str, Callable[[dict, int], PretrainedConfig]] = {
    "qwen2": _qwen2, "qwen3": _qwen3, "llama3": _llama3, "mistral": _mistral, "gemma3": _gemma3, "phi3": _phi3,
    "qwen3moe": _qwen3moe, "qwen2moe": _qwen2moe,
}


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int, family: str = "qwen2"
                ) -> PreTrainedModel:
    """A randomly initialised model of `family` with tied embeddings, deterministic from `seed`."""
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens; vocab_size {spec.vocab_size} is too small")
    common = dict(**asdict(spec), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    config = FAMILIES[family](common, spec.hidden_size // spec.num_attention_heads)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def make_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, family: str = "qwen2") -> Path:
    """Write the embedded model of `family` and the tokenizer to `out_dir` (skipped if an identical one is there)."""
    if size not in SPECS:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(SPECS)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown embedded model family {family!r}; choose one of {sorted(FAMILIES)}")
    out = Path(out_dir)
    marker = out / "qarl_embedded.json"
    identity = {"size": size, "seed": seed, "spec": asdict(SPECS[size]), "tokenizer": TOKENIZER_VERSION}
    if family != "qwen2":  # the Qwen2 models' identity (and every warm start keyed on it) as before families
        identity["family"] = family
    with exclusive(out.with_name(out.name + ".lock")):
        if marker.exists() and json.loads(marker.read_text()) == identity:
            return out
        tokenizer = build_tokenizer()
        model = build_model(SPECS[size], tokenizer, seed, family)
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
