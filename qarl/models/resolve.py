"""Where a model comes from: `policy.model_name` -> a model directory (embedded, local, or a hub id), and the
cache the embedded models and warm starts live in."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qarl.config import ConfigError

EMBEDDED_PREFIX = "embedded:"


def cache_dir() -> Path:
    return Path(os.environ.get("QARL_CACHE_DIR", Path.home() / ".cache" / "qarl"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_model_dir(model_name: str) -> str:
    """"embedded:<size>" -> a locally made model directory; a local directory -> itself; else a hub name."""
    if model_name.startswith(EMBEDDED_PREFIX):
        from qarl.models.tiny import make_tiny_model

        name = model_name[len(EMBEDDED_PREFIX):]  # "<size>" or "<size>-<family>"
        size, _, family = name.partition("-")
        try:
            return str(make_tiny_model(cache_dir() / "embedded" / name, size=size, family=family or "qwen2"))
        except ValueError as e:
            raise ConfigError(f"policy.model_name={model_name!r}: {e}") from None
    path = Path(model_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)")
        return str(path)
    if model_name.startswith((".", "/", "~")) or model_name.count("/") != 1:
        raise ConfigError(f"model not found: {model_name!r} is neither a local model directory nor a hub id (org/name)")
    return model_name  # a hub id: transformers and vLLM resolve it (needs a reachable hub or a warm cache)
