"""A run directory belongs to one run: what it holds is never overwritten by another.

A run writes its identity (`qarl_run.json`: a run id, the recipe's hash, when it started and each time it resumed)
before anything else, and each checkpoint carries that run id (`run.json`), so pruning and evaluation never mix
two runs. `plan_run_dir` decides, before anything heavy, what a training command may do with `run.dir`:

  absent or empty, or a run that never finished a step    -> a new run there
  another run's data (metrics rows, checkpoints, or files  -> refused, unless trainer.resume continues it or
  qarl did not write)                                          run.overwrite=true clears it first
  trainer.resume=true without a complete checkpoint       -> refused (trainer.resume=auto starts afresh instead)

This module imports no torch: the CLI runs it as the recipe loads.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qarl.config import ConfigError

IDENTITY = "qarl_run.json"  # in the run directory
CHECKPOINT_RUN = "run.json"  # in each checkpoint: the run id and step it belongs to
STEP_DIR = re.compile(r"^step_(\d+)$")
# What qarl writes into a run directory (anything else is a user's file, never cleared without run.overwrite).
RUN_FILES = {IDENTITY, "config.yaml", "metrics.jsonl", "metrics.tmp", "metrics.png", "summary.json", "checkpoints",
             "tensorboard", "wandb", "engine_base", "matrix"}
NOT_HASHED = ("run.overwrite", "trainer.resume", "run.dir")  # how a run is started, not what it is


def complete_checkpoints(run_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints of a run directory, oldest first; with `run_id`, only that run's (and those written before
    checkpoints carried a run id)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for path in root.glob("step_*") if root.is_dir() else []:
        match = STEP_DIR.match(path.name)
        if match and (path / "COMPLETE").is_file() and (run_id is None or checkpoint_run_id(path) in (run_id, None)):
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def checkpoint_run_id(checkpoint: Path) -> str | None:
    path = checkpoint / CHECKPOINT_RUN
    return json.loads(path.read_text())["run_id"] if path.is_file() else None


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step a checkpoint was written at: its step_N name, else its COMPLETE marker; None for a checkpoint copied
    under another name without its marker (still loadable: `qarl eval` names it without a step)."""
    match = STEP_DIR.match(checkpoint.name)
    if match:
        return int(match.group(1))
    marker = checkpoint / "COMPLETE"
    return int(marker.read_text()) if marker.is_file() else None


def read_identity(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / IDENTITY
    return json.loads(path.read_text()) if path.is_file() else None


def recipe_hash(recipe: dict[str, Any]) -> str:
    """What identifies a recipe: its resolved values, but for the keys that only say how a run starts."""
    flat = {k: v for k, v in _flatten(recipe).items() if k not in NOT_HASHED}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class RunDirPlan:
    """What a training command does with its run directory."""

    path: Path
    action: str  # "new" | "resume" | "overwrite"
    checkpoint: Path | None = None  # the checkpoint a resume continues from

    @property
    def resume_step(self) -> int | None:  # (a resume's checkpoint is always a step_N of the run)
        return checkpoint_step(self.checkpoint) if self.checkpoint is not None else None


def _metrics_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def describe_contents(run_dir: Path) -> str:
    """What a run directory holds, in a few words, for the refusal."""
    checkpoints = complete_checkpoints(run_dir)
    parts = [f"{_metrics_rows(run_dir)} metrics rows"]
    if checkpoints:
        parts.append(f"{len(checkpoints)} checkpoint(s) up to step {checkpoint_step(checkpoints[-1])}")
    identity = read_identity(run_dir)
    if identity:
        parts.append(f"run {identity['run_id']} started {identity['started']}")
    return ", ".join(parts)


def _refuse_to_clear(path: Path) -> None:
    """run.overwrite clears a directory: never one that holds the working directory, the home or the filesystem root."""
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved in (Path.home().resolve(), Path("/")):
        raise ConfigError(f"run.overwrite=true would clear {resolved}, which holds the working directory or is the "
                          "home or root directory: set run.dir to a directory of its own")


def plan_run_dir(run_dir: str | Path, resume: str, overwrite: bool) -> RunDirPlan:
    """What a training command may do with `run_dir` (see the module's docstring); a refusal names the ways out.
    Reads only: `claim_run_dir` acts on the plan once the run starts."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={path} is a file, not a directory: set run.dir to a directory")
    if overwrite and resume != "false":
        raise ConfigError(f"run.overwrite=true clears run.dir and trainer.resume={resume} continues it: choose one")
    if overwrite:
        _refuse_to_clear(path)
        return RunDirPlan(path, "overwrite" if path.is_dir() and any(path.iterdir()) else "new")
    identity = read_identity(path)
    checkpoints = complete_checkpoints(path, identity["run_id"] if identity else None)
    if resume in ("true", "auto") and checkpoints:
        return RunDirPlan(path, "resume", checkpoints[-1])
    if resume == "true":
        raise ConfigError(f"trainer.resume=true, but run.dir={path} holds no complete checkpoint to continue from"
                          f"{_runs_beside(path)}: name the run's directory with run.dir=..., use trainer.resume=auto "
                          "(continue if there is a checkpoint, else start afresh), or leave trainer.resume out")
    contents = {p.name for p in path.iterdir()} if path.is_dir() else set()
    foreign = sorted(contents - RUN_FILES)
    if foreign:
        raise ConfigError(f"run.dir={path} holds files qarl did not write ({', '.join(foreign[:5])}"
                          f"{', ...' if len(foreign) > 5 else ''}): choose another run.dir, or run.overwrite=true to "
                          "clear it first")
    if _metrics_rows(path) or complete_checkpoints(path):
        raise ConfigError(f"run.dir={path} holds another run ({describe_contents(path)}): continue it with "
                          "trainer.resume=true, clear it with run.overwrite=true, or choose another run.dir")
    return RunDirPlan(path, "new")


def _runs_beside(path: Path) -> str:
    """Run directories next to `path` that hold checkpoints (where a user may have meant to resume), in words."""
    parent = path.parent if path.parent.is_dir() else None
    runs = sorted(p for p in parent.iterdir() if p.is_dir() and complete_checkpoints(p)) if parent else []
    return f" (runs with checkpoints beside it: {', '.join(map(str, runs[-3:]))})" if runs else ""


def claim_run_dir(plan: RunDirPlan, recipe: dict[str, Any], config_yaml: str) -> str:
    """Act on `plan`: clear the directory (overwrite), write the run's identity (new) or note the resume, and write the
    recipe as config.yaml. Returns the run id. Called by the main process only."""
    path = plan.path
    if plan.action == "overwrite":
        print(f"run.overwrite=true: clearing {path} ({describe_contents(path)})")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    identity = read_identity(path) if plan.action == "resume" else None
    if identity is None:  # a new run (or a resumed one written before runs had an identity)
        identity = {"run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}", "started": now,
                    "recipe_hash": recipe_hash(recipe), "resumed": []}
    if plan.action == "resume":
        changed = _changed_keys(path / "config.yaml", recipe)
        identity["resumed"].append({"at": now, "from_step": plan.resume_step, "recipe_hash": recipe_hash(recipe)})
        print(f"resuming from step {plan.resume_step} ({plan.checkpoint})"
              + (f"; changed settings: {', '.join(changed)}" if changed else ""))
    tmp = path / f"{IDENTITY}.tmp"
    tmp.write_text(json.dumps(identity, indent=2))
    tmp.replace(path / IDENTITY)
    (path / "config.yaml").write_text(config_yaml)
    return identity["run_id"]


def _changed_keys(old_config: Path, recipe: dict[str, Any]) -> list[str]:
    """The keys whose values differ from the run's previous config.yaml (a resume may change, e.g., trainer.steps)."""
    import yaml

    if not old_config.is_file():
        return []
    old, new = _flatten(yaml.safe_load(old_config.read_text()) or {}), _flatten(recipe)
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k not in NOT_HASHED and old.get(k) != new.get(k)]
