"""Cheap checks of Hugging Face model directories, before anything heavy loads: can it load, does it
share a tokenizer with another, how large is it. Used by QAD (teacher vs student) and `qarl matrix`
(every model vs the base). Architectures are built on the meta device: nothing is read or allocated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qarl.config import ConfigError


def load_pretrained(loader: Any, model_dir: str, trust_remote_code: bool) -> Any:
    """AutoConfig / AutoTokenizer, with an unreachable hub id or a broken directory as a ConfigError."""
    try:
        return loader.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model_dir!r} could not be loaded ({first_line}). A hub id needs HF_HUB_OFFLINE=0 "
                          "and a reachable hub (or a warm cache); else give a local model directory.") from None


def vocab_width(model_dir: str, trust_remote_code: bool = False) -> int:
    """The number of logits the model outputs."""
    return load_pretrained(AutoConfig, model_dir, trust_remote_code).get_text_config().vocab_size


def with_pad_token(tokenizer: Any) -> Any:
    """qarl pads with the EOS token where a tokenizer names no pad token (the attention mask hides pads: which token
    pads never changes a log-prob). Checkpoints save the tokenizer padded so; compare their base, which named no pad,
    through this too."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_differences(a_dir: str, b_dir: str, trust_remote_code: bool = False) -> list[str]:
    """What differs between two models' tokenizers and output widths (empty: token ids mean the same)."""
    a = with_pad_token(load_pretrained(AutoTokenizer, a_dir, trust_remote_code))
    b = with_pad_token(load_pretrained(AutoTokenizer, b_dir, trust_remote_code))
    problems = []
    a_vocab, b_vocab = a.get_vocab(), b.get_vocab()
    if a_vocab != b_vocab:
        differ = sorted(k for k in a_vocab.keys() | b_vocab.keys() if a_vocab.get(k) != b_vocab.get(k))
        problems.append(f"vocabularies differ ({len(a_vocab)} vs {len(b_vocab)} tokens, {len(differ)} tokens "
                        f"with different ids, e.g. {differ[:3]})")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(a, attr) != getattr(b, attr):
            problems.append(f"{attr}: {getattr(a, attr)!r} vs {getattr(b, attr)!r}")
    if sorted(a.all_special_tokens) != sorted(b.all_special_tokens):
        problems.append("special tokens differ")
    a_width, b_width = vocab_width(a_dir, trust_remote_code), vocab_width(b_dir, trust_remote_code)
    if not problems and a_width != b_width:
        problems.append(f"output vocabulary widths differ ({a_width} vs {b_width} logits)")
    return problems


def meta_model(model_dir: str, trust_remote_code: bool = False) -> nn.Module:
    """The model's architecture on the meta device: shapes and names, no weights."""
    config = load_pretrained(AutoConfig, model_dir, trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def parameter_count(model_dir: str, trust_remote_code: bool = False) -> int:
    """Parameters of a model directory's architecture."""
    return sum(p.numel() for p in meta_model(model_dir, trust_remote_code).parameters())
