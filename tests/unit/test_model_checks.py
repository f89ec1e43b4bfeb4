"""Tokenizer comparison (QAD's teacher vs student, `qarl matrix`'s models vs the base): a checkpoint qarl saved from a
base whose tokenizer names no pad token (SmolLM2's) is the base's tokenizer; a real difference is still named."""

from __future__ import annotations

import shutil

from transformers import AutoTokenizer

from qarl.models.checks import tokenizer_differences


def _copy(tiny_dir: str, dest, pad_token: str | None) -> str:
    shutil.copytree(tiny_dir, dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    tokenizer.pad_token = pad_token
    tokenizer.save_pretrained(dest)
    return str(dest)


def test_a_checkpoint_of_a_base_without_pad_token_shares_its_tokenizer(tiny_dir, tmp_path):
    plain = AutoTokenizer.from_pretrained(tiny_dir)
    base = _copy(tiny_dir, tmp_path / "base", None)  # the base names no pad token
    assert AutoTokenizer.from_pretrained(base).pad_token is None
    trained = _copy(tiny_dir, tmp_path / "trained", plain.eos_token)  # as build_policy pads it and saves it
    assert tokenizer_differences(base, trained) == []
    assert tokenizer_differences(trained, base) == []
    other = _copy(tiny_dir, tmp_path / "other", plain.pad_token)  # a real pad token that is not the EOS
    assert any(p.startswith("pad_token") for p in tokenizer_differences(base, other))
