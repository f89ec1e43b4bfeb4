"""Where a command writes, checked writable before anything runs: a read-only `run.dir` or `QARL_CACHE_DIR` is one
line in about a second, not a PermissionError after the models load.

This module imports no torch: the CLI runs it as the recipe loads.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from qarl.config import ConfigError, RecipeConfig
from qarl.models.resolve import EMBEDDED_PREFIX, PYPI_PREFIX, cache_dir


def check_writable(path: Path, key: str, fix: str) -> None:
    """`path` (set by `key`) can be made and written: the directory itself, or the nearest one above it that exists.
    Tried by writing a nameless temporary file there (os.access answers yes to root on a read-only mount). A path
    that exists as a file is left to the command, which says what it expects there. `fix`: what to do instead."""
    path = path.expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        return
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, so no directory can be made under it; {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot write in {existing} ({e.strerror}); {fix}") from None


def uses_cache(cfg: RecipeConfig) -> bool:
    """Whether a recipe makes or reads models in the qarl cache: an embedded or PyPI model, or a warm start."""
    models = (cfg.policy.model_name, cfg.teacher.model_name)
    return cfg.warm_start.enabled or any(m.startswith((EMBEDDED_PREFIX, PYPI_PREFIX)) for m in models)


# What each command writes under the recipe's keys (the cache aside): key -> the path it names.
WRITES = {"train": ("run.dir",), "distill": ("run.dir",), "matrix": ("matrix.out",)}


def check_outputs(cfg: RecipeConfig, command: str) -> None:
    """What `command` will write, writable: its outputs (WRITES) and the cache, when the recipe uses it."""
    values = {"run.dir": cfg.run.dir, "matrix.out": cfg.matrix.out}
    for key in WRITES.get(command, ()):
        check_writable(Path(values[key]), key, f"choose a {key} you can write")
    if command != "config" and uses_cache(cfg):
        check_writable(cache_dir(), "QARL_CACHE_DIR", "set QARL_CACHE_DIR to a directory you can write (it holds the "
                                                      "embedded models, PyPI conversions and warm starts)")
