"""The embedded default model: a tiny Qwen2 with a character-level tokenizer, made locally.

No machine here reaches a model hub, so qarl builds its own model: deterministic from a seed and
saved as an ordinary Hugging Face directory that transformers and vLLM load like any other. Every
linear layer's input width is a multiple of 32, so NVFP4 (blocks of 16) and FP8 apply to all of them.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from qarl.distributed import exclusive

PAD, EOS = "<|pad|>", "<|endoftext|>"
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
    """A character-level tokenizer: every printable ASCII character is one token."""
    vocab = {PAD: 0, EOS: 1}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=None, unk_token=EOS,
        model_max_length=SPECS["tiny"].max_position_embeddings,
    )


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 with tied embeddings, deterministic from `seed`."""
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens; vocab_size {spec.vocab_size} is too small")
    config = Qwen2Config(
        **asdict(spec),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the embedded model and tokenizer to `out_dir` (skipped if an identical one is there)."""
    if size not in SPECS:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(SPECS)}")
    out = Path(out_dir)
    marker = out / "qarl_embedded.json"
    identity = {"size": size, "seed": seed, "spec": asdict(SPECS[size])}
    with exclusive(out.with_name(out.name + ".lock")):
        if marker.exists() and json.loads(marker.read_text()) == identity:
            return out
        tokenizer = build_tokenizer()
        model = build_model(SPECS[size], tokenizer, seed)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "qarl_embedded.json").write_text(json.dumps(identity))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
    return out
