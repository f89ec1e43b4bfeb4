"""A run directory belongs to one run: what it holds is never overwritten by another.

A run writes its identity (`qarl_run.json`: a run id, the recipe's hash, when it started and each time it resumed)
before anything else, and each checkpoint carries that run id (`run.json`), so pruning and evaluation never mix
two runs. `plan_run_dir` decides, before anything heavy, what a training command may do with `run.dir`:

  absent or empty, or a run that never finished a step    -> a new run there
  another run's data (metrics rows, checkpoints, or files  -> refused, unless trainer.resume continues it or
  qarl did not write)                                          run.overwrite=true clears it first
  trainer.resume=true without a complete checkpoint       -> refused (trainer.resume=auto starts afresh instead)

Before it decides, the run locks the directory (`own_run_dir`, qarl/dir_lock.py: RUN_DIR/.qarl.lock), so two runs
started at one instant cannot both find it empty, and a run that is still going is never resumed or written over.

A checkpoint carries a manifest (`manifest.json`: every file's size and sha256), written before its COMPLETE marker.
A resume continues from the newest checkpoint whose files match it (sizes as the command starts, hashes where the
checkpoint is about to load); a damaged newer one is named and skipped, and pruning never counts one.

This module imports no torch: the CLI runs it as the recipe loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qarl.config import ConfigError
from qarl.dir_lock import LOCK_FILE, DirLock, check_not_in_use, held, take_lock

IDENTITY = "qarl_run.json"  # in the run directory
CHECKPOINT_RUN = "run.json"  # in each checkpoint: the run id and step it belongs to
MANIFEST = "manifest.json"  # in each checkpoint: every file's size and sha256
STEP_DIR = re.compile(r"^step_(\d+)$")
# What qarl writes into a run directory (anything else is a user's file, never cleared without run.overwrite).
RUN_FILES = {IDENTITY, "config.yaml", "metrics.jsonl", "metrics.tmp", "metrics.jsonl.damaged", "metrics.png",
             "summary.json", "checkpoints", "tensorboard", "wandb", "engine_base", "matrix", LOCK_FILE}
NOT_HASHED = ("run.overwrite", "trainer.resume", "run.dir")  # how a run is started, not what it is


def is_main_launch() -> bool:
    """Whether torchrun launched this process as rank 0 (or without torchrun): known before torch.distributed starts,
    for what one process does first (locking and claiming the run directory). torchrun sets RANK and LOCAL_RANK; a
    RANK some other launcher set alone, or that is no number, is not a torchrun rank."""
    rank = os.environ.get("RANK", "0").strip()
    return "LOCAL_RANK" not in os.environ or not rank.isdigit() or int(rank) == 0


def own_run_dir(run_dir: str | Path, resume: str, overwrite: bool) -> DirLock | None:
    """Lock `run_dir` for this run before anything reads or writes it (qarl/dir_lock.py), held until the process
    ends: by the process torchrun launched as rank 0, or the only one; None in the others. A lock left by a run that
    ended without releasing it is taken over only with trainer.resume=true|auto or run.overwrite=true."""
    if not is_main_launch():
        return None
    path = Path(run_dir)
    _refuse_a_file(path)
    return take_lock(path / LOCK_FILE, f"run.dir={path}", resume != "false" or overwrite,
                     "trainer.resume=true|auto (continue the run) or run.overwrite=true (clear it)",
                     "choose another run.dir")


def run_dir_lock(run_dir: str | Path) -> DirLock | None:
    """This process's lock on `run_dir`, if it holds one."""
    return held(Path(run_dir) / LOCK_FILE)


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


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is one qarl checkpoint (a whole policy's or a LoRA adapter's)."""
    return (path / "policy").is_dir() or (path / "lora.json").is_file()


def is_run_or_checkpoint(path: Path) -> bool:
    """Whether `path` is a qarl checkpoint or a run directory: what a model name may also be (its newest intact
    checkpoint's model)."""
    return path.is_dir() and (is_checkpoint_dir(path) or (path / "checkpoints").is_dir() or (path / IDENTITY).is_file())


def latest_checkpoint(run_dir: str | Path, hashes: bool = True) -> Path | None:
    """The newest intact complete checkpoint of the run in `run_dir` (its identity's run id; its files hashed against
    its manifest, or their sizes alone without `hashes`), naming on the console the newer damaged ones it skips; None
    if the run has no complete one."""
    found = complete_checkpoints(run_dir, (read_identity(run_dir) or {}).get("run_id"))
    if not found:
        return None
    checkpoint, damaged = newest_intact(found, hashes)
    if checkpoint is None:
        raise ConfigError(f"every checkpoint of {run_dir} is damaged ({'; '.join(damaged)}): restore their files, or "
                          "give another checkpoint")
    if damaged:
        print(f"using {checkpoint}: skipped the newer damaged checkpoint(s) {'; '.join(damaged)}")
    return checkpoint


def resolve_checkpoint(path: str | Path, hashes: bool = True) -> Path:
    """A checkpoint directory (intact: its files match its manifest), or a run directory (its newest intact complete
    checkpoint); without `hashes` the files' sizes alone are checked (the CLI's quick look before anything loads)."""
    path = Path(path)
    if is_checkpoint_dir(path):
        if (path.parent.name == "checkpoints") and not (path / "COMPLETE").is_file():
            raise ConfigError(f"checkpoint {path} is incomplete (no COMPLETE marker): it was never finished")
        damage = checkpoint_damage(path, hashes)
        if damage is not None:
            raise ConfigError(f"checkpoint {path} is damaged ({damage}): give an earlier checkpoint, or the run "
                              "directory (its newest intact checkpoint)")
        return path
    latest = latest_checkpoint(path, hashes)
    if latest is None:
        raise ConfigError(f"no checkpoint found at {path}: expected a step_N directory or a run directory")
    return latest


def named_checkpoint(model_name: str, hashes: bool = True) -> Path | None:
    """The qarl checkpoint a model name stands for (`policy.model_name` or `teacher.model_name` may name a checkpoint
    directory, or a run directory: its newest intact checkpoint), None for any other name. A run still running is
    refused (its newest checkpoint is not yet its last), and so is a LoRA checkpoint: its adapter would be lost, the
    run starting from its base alone."""
    path = Path(model_name).expanduser()
    if not is_run_or_checkpoint(path):
        return None
    run_dir = path.parent.parent if is_checkpoint_dir(path) and path.parent.name == "checkpoints" else path
    check_not_in_use(run_dir / LOCK_FILE, model_name, "name a copy of one of its checkpoints (RUN/checkpoints/step_N, "
                     "which its run may prune)")
    checkpoint = resolve_checkpoint(path, hashes)
    if (checkpoint / "lora.json").is_file():
        raise ConfigError(f"{model_name} is a LoRA checkpoint ({checkpoint}): a run starts from a whole model; merge "
                          f"its adapter first with `qarl export {checkpoint} --dequantized --out DIR` and name DIR")
    return checkpoint


def checkpoint_run_id(checkpoint: Path) -> str | None:
    """The run a checkpoint belongs to; None where it says none (written before checkpoints carried a run id) or
    cannot be read: its manifest then names the damage where the checkpoint is verified."""
    path = checkpoint / CHECKPOINT_RUN
    try:
        return json.loads(path.read_text())["run_id"] if path.is_file() else None
    except (ValueError, KeyError, TypeError):  # (a JSONDecodeError and a UnicodeDecodeError are ValueErrors)
        return None


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step a checkpoint was written at: its step_N name, else its COMPLETE marker; None for a checkpoint copied
    under another name without its marker (still loadable: `qarl eval` names it without a step)."""
    match = STEP_DIR.match(checkpoint.name)
    if match:
        return int(match.group(1))
    marker = checkpoint / "COMPLETE"
    try:
        return int(marker.read_text()) if marker.is_file() else None
    except ValueError:  # a marker emptied or overwritten: the checkpoint's manifest says whether its files are whole
        return None


def write_manifest(checkpoint: Path) -> None:
    """Every file of a checkpoint with its size and sha256, written before its COMPLETE marker, so that a file damaged
    later (truncated by a full disk or a partial copy, or overwritten) is found before the checkpoint loads."""
    paths = [f for f in sorted(checkpoint.rglob("*")) if f.is_file() and f.name not in (MANIFEST, "COMPLETE")]
    files = {f.relative_to(checkpoint).as_posix(): {"bytes": f.stat().st_size, "sha256": digest}
             for f, digest in zip(paths, _sha256s(paths))}
    (checkpoint / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    _HASHED[_manifest_key(checkpoint)] = None  # hashed as written: intact


_HASHED: dict[tuple[int, int, int], str | None] = {}  # a manifest's (device, inode, mtime) -> its hashed verdict


def checkpoint_damage(checkpoint: Path, hashes: bool = True) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, in words ("policy/model.safetensors is 1,024
    bytes, not 538,000,000"), or None: intact, or written before checkpoints had a manifest (accepted as before on
    its COMPLETE marker, without a word: there is nothing a user could do about it). `hashes`: also read every file
    (seconds for a large checkpoint; once a process), else check sizes only (at once)."""
    path = checkpoint / MANIFEST
    if not path.is_file():
        return None
    try:
        files = {name: (int(want["bytes"]), str(want["sha256"])) for name, want in
                 json.loads(path.read_text())["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is unreadable"
    for name, (size, _) in files.items():
        found = (checkpoint / name).stat().st_size if (checkpoint / name).is_file() else None
        if found is None:
            return f"{name} is missing"
        if found != size:
            return f"{name} is {found:,} bytes, not {size:,}"
    key = _manifest_key(checkpoint)
    if not hashes or key in _HASHED:
        return _HASHED.get(key)
    digests = _sha256s([checkpoint / name for name in files])
    wrong = [name for (name, (_, want)), digest in zip(files.items(), digests) if digest != want]
    _HASHED[key] = f"{', '.join(wrong)}: content differs from the manifest's sha256" if wrong else None
    return _HASHED[key]


def _manifest_key(checkpoint: Path) -> tuple[int, int, int]:
    """A manifest's identity that a rename (step_N.tmp -> step_N) keeps and a rewrite changes."""
    stat = (checkpoint / MANIFEST).stat()
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns


def _sha256s(paths: list[Path]) -> list[str]:
    """The files' sha256, a file a thread (hashlib lets go of the GIL): a checkpoint's large files hash side by side."""
    def sha256(path: Path) -> str:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor() as pool:
        return list(pool.map(sha256, paths))


def newest_intact(checkpoints: list[Path], hashes: bool = True) -> tuple[Path | None, list[str]]:
    """The newest of `checkpoints` (oldest first) with nothing wrong (`checkpoint_damage`), and each newer one with
    what is wrong with it, in words."""
    damaged = []
    for checkpoint in reversed(checkpoints):
        damage = checkpoint_damage(checkpoint, hashes)
        if damage is None:
            return checkpoint, damaged
        damaged.append(f"{checkpoint} ({damage})")
    return None, damaged


def prunable(checkpoints: list[Path], keep: int) -> list[Path]:
    """The checkpoints (oldest first) that `checkpoint.keep` lets go: all older than the newest `keep` intact ones
    (keep <= 0: none). A damaged checkpoint never counts toward `keep`, so the last intact one is never deleted in
    favour of it."""
    if keep <= 0:
        return []
    intact = 0
    for i in range(len(checkpoints) - 1, -1, -1):
        intact += checkpoint_damage(checkpoints[i]) is None
        if intact == keep:
            return checkpoints[:i]
    return []


def read_identity(run_dir: str | Path) -> dict[str, Any] | None:
    """The run directory's identity file (run id, recipe hash, ...), None where there is none."""
    path = Path(run_dir) / IDENTITY
    if not path.is_file():
        return None
    try:
        identity = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path} is damaged ({type(e).__name__}): restore it, or start the run again with "
                          "run.overwrite=true (which clears the run directory)") from None
    if not isinstance(identity, dict):
        raise ConfigError(f"{path} is damaged (not a JSON object): restore it, or start the run again with "
                          "run.overwrite=true (which clears the run directory)")
    return identity


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
    damaged: tuple[str, ...] = ()  # newer checkpoints a resume skips, each with what is wrong with it

    @property
    def resume_step(self) -> int | None:  # (a resume's checkpoint is always a step_N of the run)
        return checkpoint_step(self.checkpoint) if self.checkpoint is not None else None


def _metrics_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    text = path.read_text(errors="surrogateescape") if path.is_file() else ""  # a damaged byte is still a row
    return sum(1 for line in text.splitlines() if line.strip())


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


def _refuse_a_file(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={path} is a file, not a directory: set run.dir to a directory")


def plan_run_dir(run_dir: str | Path, resume: str, overwrite: bool, hashes: bool = False) -> RunDirPlan:
    """What a training command may do with `run_dir` (see the module's docstring); a refusal names the ways out.
    A resume's checkpoint is checked against its manifest: file sizes, and with `hashes` every file's sha256 (seconds
    for a large checkpoint: the run does it as it starts, not the command). Reads only: `claim_run_dir` acts on the
    plan once the run starts."""
    path = Path(run_dir)
    _refuse_a_file(path)
    if overwrite and resume != "false":
        raise ConfigError(f"run.overwrite=true clears run.dir and trainer.resume={resume} continues it: choose one")
    if overwrite:
        _refuse_to_clear(path)
        return RunDirPlan(path, "overwrite" if _contents(path) - {LOCK_FILE} else "new")
    identity = read_identity(path)
    checkpoints = complete_checkpoints(path, identity["run_id"] if identity else None)
    if resume in ("true", "auto") and checkpoints:
        checkpoint, damaged = newest_intact(checkpoints, hashes)
        if checkpoint is None:
            raise ConfigError(f"run.dir={path}: every checkpoint is damaged ({'; '.join(damaged)}): restore their "
                              "files, or start afresh with run.overwrite=true")
        return RunDirPlan(path, "resume", checkpoint, tuple(damaged))
    if resume == "true":
        raise ConfigError(f"trainer.resume=true, but run.dir={path} holds no complete checkpoint to continue from"
                          f"{_runs_beside(path)}: name the run's directory with run.dir=..., use trainer.resume=auto "
                          "(continue if there is a checkpoint, else start afresh), or leave trainer.resume out")
    foreign = sorted(_contents(path) - RUN_FILES)
    if foreign:
        raise ConfigError(f"run.dir={path} holds files qarl did not write ({', '.join(foreign[:5])}"
                          f"{', ...' if len(foreign) > 5 else ''}): choose another run.dir, or run.overwrite=true to "
                          "clear it first")
    if _metrics_rows(path) or complete_checkpoints(path):
        raise ConfigError(f"run.dir={path} holds another run ({describe_contents(path)}): continue it with "
                          "trainer.resume=true, clear it with run.overwrite=true, or choose another run.dir")
    return RunDirPlan(path, "new")


def _contents(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def _runs_beside(path: Path) -> str:
    """Run directories next to `path` that hold checkpoints (where a user may have meant to resume), in words."""
    parent = path.parent if path.parent.is_dir() else None
    runs = sorted(p for p in parent.iterdir() if p.is_dir() and complete_checkpoints(p)) if parent else []
    return f" (runs with checkpoints beside it: {', '.join(map(str, runs[-3:]))})" if runs else ""


def claim_run_dir(plan: RunDirPlan, recipe: dict[str, Any], config_yaml: str) -> str:
    """Act on `plan`: clear the directory (overwrite; all but the run's lock), write the run's identity (new) or note
    the resume (naming the damaged checkpoints it skips), and write the recipe as config.yaml. Returns the run id,
    which the lock file then names too. Called by the main process only."""
    path = plan.path
    if plan.action == "overwrite":
        print(f"run.overwrite=true: clearing {path} ({describe_contents(path)})")
        _clear(path)
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
              + (f"; changed settings: {', '.join(changed)}" if changed else "")
              + (f"; skipped the newer damaged checkpoint(s): {'; '.join(plan.damaged)}" if plan.damaged else ""))
    tmp = path / f"{IDENTITY}.tmp"
    tmp.write_text(json.dumps(identity, indent=2))
    tmp.replace(path / IDENTITY)
    (path / "config.yaml").write_text(config_yaml)
    lock = run_dir_lock(path)
    if lock is not None:
        lock.note(run_id=identity["run_id"])
    return identity["run_id"]


def _clear(path: Path) -> None:
    """Everything in `path` but the run's lock file."""
    for entry in path.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _recorded(config: Path) -> dict[str, Any]:
    """A run's config.yaml, flattened to dotted keys ({} where there is none)."""
    import yaml

    return _flatten(yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}


def recorded_value(config: Path, key: str) -> Any:
    """One dotted key's value in a run's config.yaml, None where it has none."""
    return _recorded(config).get(key)


def _changed_keys(old_config: Path, recipe: dict[str, Any]) -> list[str]:
    """The keys whose values differ from the run's previous config.yaml (a resume may change, e.g., trainer.steps)."""
    if not old_config.is_file():
        return []
    old, new = _recorded(old_config), _flatten(recipe)
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k not in NOT_HASHED and old.get(k) != new.get(k)]
