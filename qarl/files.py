"""Files qarl writes get the mode the user's umask gives a new file.

safetensors 0.8 writes each file through a temporary file, created 0600, that it renames into place (safetensors
issue #782), so every `model.safetensors` of a checkpoint, an export or a cached model came out readable by its owner
alone, unlike the config and tokenizer beside it. qarl assembles each such directory under a temporary name;
`give_umask_modes` sets its files' modes before it is renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask: Linux says it in /proc/self/status; elsewhere it is read by setting it (POSIX offers no
    other way) to a stricter mask for an instant, which a file another thread made in that instant would get."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def umask_mode() -> int:
    """The mode a new file gets under the process's umask: 0o666 less the umask (0o644 under the usual 022)."""
    return 0o666 & ~umask()


def give_umask_modes(root: Path) -> None:
    """Every regular file under `root` (or `root` itself, a file) to `umask_mode()`."""
    mode = umask_mode()
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)
