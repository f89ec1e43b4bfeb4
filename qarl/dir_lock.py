"""A directory qarl writes is owned by one process at a time: a run's `run.dir`, `qarl matrix`'s `matrix.out`,
`qarl export`'s `--out`.

The owner holds an exclusive `flock` on a lock file for as long as it lives (the kernel drops it when the process
ends, however it ends) and writes into the file who it is: host, pid, command, since when, and the run id once
known. A second process is refused at once, naming the first. A lock file that still names an owner but is no
longer locked was left by a process that ended without releasing it (killed, or its machine went down): what it
wrote may be half done, so the directory is taken over only where the user says what to do with it (a run's
`trainer.resume` or `run.overwrite`, export's `--overwrite`). A normal exit removes the lock file (and the
directory, where the lock made it and nothing else was written).

This module imports no torch: the CLI takes the lock as the recipe loads, before anything heavy.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from qarl.config import ConfigError

LOCK_FILE = ".qarl.lock"  # in the directory it guards (beside it for a directory replaced whole: `beside`)
READ_WAIT_S = 0.5  # how long a refused process waits for the owner to finish writing who it is
COMMAND_CHARS = 200  # of the owner's command, in a message


@dataclass
class DirLock:
    """The lock this process holds on a directory, until `release` (or the process's end)."""

    file: Path
    handle: IO[str]
    owner: dict[str, Any]
    made: list[Path]  # the directories taking the lock created, outermost first

    def note(self, **fields: Any) -> None:
        """Add to what the lock file says of its owner (e.g. the run id, once the run has one)."""
        self.owner.update(fields)
        _write_owner(self.handle, self.owner)

    def release(self) -> None:
        """Remove the lock file, then unlock; remove the directories the lock made if nothing else was written."""
        _HELD.pop(self.file, None)
        self.file.unlink(missing_ok=True)  # first: a process that opens the path next makes a new file
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        _remove_made(self.made)


_HELD: dict[Path, DirLock] = {}  # lock file (resolved) -> this process's lock on it


def held(lock_file: Path) -> DirLock | None:
    """This process's lock on `lock_file`, if it holds one."""
    return _HELD.get(lock_file.resolve())


def beside(directory: Path) -> Path:
    """The lock file of a directory that is replaced whole by a rename (an export): next to it, DIR.qarl.lock."""
    directory = directory.resolve()
    return directory.with_name(directory.name + LOCK_FILE)


def take_lock(lock_file: Path, label: str, takeover: bool, takeover_with: str, instead: str) -> DirLock:
    """Own the directory `lock_file` guards (this process's lock if it holds it already), or raise ConfigError naming
    the owner. `label` names the directory as the user gave it ("run.dir=runs/x"); a lock left by a process that
    ended is taken over only with `takeover`, else refused naming `takeover_with` (the settings that allow it) and
    `instead` (what else to do, "choose another run.dir")."""
    mine = held(lock_file)
    if mine is not None:
        return mine
    made = _make_dirs(lock_file.parent, label)
    try:
        handle = _locked(lock_file, label, instead)
    except BaseException:
        _remove_made(made)
        raise
    left = _read_owner(lock_file)
    if left is not None:  # (so the directory was there: the lock made none)
        if not takeover:
            handle.close()
            raise ConfigError(f"{label} holds {_left_words(left)}, so what it wrote may be incomplete: take it over "
                              f"with {takeover_with}, or {instead}")
        print(f"{label}: taking over {_left_words(left)}")
    lock = DirLock(lock_file.resolve(), handle, _this_process(), made)
    _write_owner(handle, lock.owner)
    _HELD[lock.file] = lock
    return lock


@contextmanager
def owning(lock_file: Path, label: str, takeover: bool, takeover_with: str, instead: str) -> Iterator[DirLock]:
    """`take_lock` for a `with` block: a command that owns its directory while its work lasts (`qarl matrix`, `qarl
    export`), not for the life of the process."""
    mine = held(lock_file)
    lock = mine or take_lock(lock_file, label, takeover, takeover_with, instead)
    try:
        yield lock
    finally:
        if mine is None:
            lock.release()


def check_not_in_use(lock_file: Path, label: str, instead: str) -> None:
    """Refuse, naming its owner, a directory whose lock a running process holds: what it holds is still being
    written. Takes nothing (a shared lock for an instant) and writes nothing."""
    try:
        handle = open(lock_file)
    except OSError:  # no lock file: no one holds it
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{label} is in use by {_running_words(lock_file)}: wait for it to finish, or "
                              f"{instead}") from None
        fcntl.flock(handle, fcntl.LOCK_UN)


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """A directory a command writes whole (`qarl export --out`) must not hold anything yet, unless `overwrite`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output directory {out_dir} is a file; choose another --out (--overwrite replaces a "
                          "directory only)")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {out_dir} exists and is not empty; choose another or pass --overwrite")


def _make_dirs(directory: Path, label: str) -> list[Path]:
    """Create `directory` and its missing parents; returns those created, outermost first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()][::-1]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{label}: cannot create {directory} ({e.strerror}): choose a directory you can write "
                          "to") from e
    return missing


def _remove_made(made: list[Path]) -> None:
    """Remove the directories a lock made, innermost first, while they are empty (nothing else was written)."""
    for directory in reversed(made):
        try:
            directory.rmdir()
        except OSError:
            break


def _locked(lock_file: Path, label: str, instead: str) -> IO[str]:
    """`lock_file` opened and flocked by this process, or ConfigError naming the process that holds it. A lock file
    removed (by its owner's release) between our open and our lock is opened again: the lock must be on the file the
    path names now."""
    while True:
        try:
            handle = open(lock_file, "a+")
        except OSError as e:
            raise ConfigError(f"{label}: cannot write {lock_file} ({e.strerror}): choose a directory you can write "
                              "to") from e
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(f"{label} is in use by {_running_words(lock_file)}: wait for it to finish or stop it, "
                              f"or {instead}") from None
        try:
            same = os.stat(lock_file).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()


def _this_process() -> dict[str, Any]:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    argv[0] = Path(argv[0]).name  # `python -m qarl train ...`, without the interpreter's path
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": shlex.join(argv)}


def _write_owner(handle: IO[str], owner: dict[str, Any]) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(owner) + "\n")
    handle.flush()


def _read_owner(lock_file: Path) -> dict[str, Any] | None:
    """Who the lock file names, or None if it names no one (new, or released); {} for unreadable contents."""
    text = lock_file.read_text(errors="replace") if lock_file.is_file() else ""
    if not text.strip():
        return None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _running_words(lock_file: Path) -> str:
    """The process that holds `lock_file`, in words (it may still be writing who it is: wait a moment for it)."""
    deadline = time.monotonic() + READ_WAIT_S
    owner = _read_owner(lock_file)
    while not owner and time.monotonic() < deadline:
        time.sleep(0.05)
        owner = _read_owner(lock_file)
    if not owner:
        return "another qarl process (it has not yet written who it is)"
    if owner.get("host") == socket.gethostname() and not _alive(owner.get("pid")):
        return f"a child process of {_owner_words(owner)}, which has ended while the child holds its lock"
    return f"another qarl process, {_owner_words(owner)}"


def _left_words(owner: dict[str, Any]) -> str:
    """A lock file that names `owner` and that no process holds, in words."""
    if not owner:
        return "a lock left by a qarl process that ended without releasing it (its lock file is unreadable)"
    if owner.get("host") != socket.gethostname():
        return (f"the lock of {_owner_words(owner)}, another host, whose process cannot be checked from here (if it "
                "is still running, wait for it)")
    state = "no longer running" if not _alive(owner.get("pid")) else "its pid now another process's"
    return f"the lock left by {_owner_words(owner)}, which ended without releasing it ({state}: killed or crashed)"


def _owner_words(owner: dict[str, Any]) -> str:
    run = f", run {owner['run_id']}" if owner.get("run_id") else ""
    command = " ".join(str(owner.get("command", "?")).split())
    command = command if len(command) <= COMMAND_CHARS else command[:COMMAND_CHARS - 3] + "..."
    return f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}{run} (`{command}`)"


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _release_all() -> None:
    """At the process's end: its locks let go (never by a forked child, which inherits the parent's table)."""
    for lock in list(_HELD.values()):
        if lock.owner["pid"] == os.getpid():
            lock.release()


atexit.register(_release_all)
