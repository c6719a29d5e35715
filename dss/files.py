"""Small file-system helpers shared by the disk tier and the key file."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock_exclusive(path: Path) -> IO[bytes] | None:
    """Open (creating it 0600) and `flock` `path` exclusively without waiting: the open file,
    which holds the lock until it is closed; None when another process holds it."""
    f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "a+b")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
