"""Shared-memory directories for host arenas: private, checked on every open, recorded so the
next owner removes the one a crashed owner left.

Files. Every tier makes its own directory, `dss-<pid>-<128 random bits>`, with one exclusive
`mkdir(0o700)` in the shared-memory base (`/dev/shm`): nothing another local user planted there (a
directory, a symlink) can be taken for ours, and the name cannot be guessed ahead of time. Arena
files are created `O_EXCL | O_NOFOLLOW`, mode 0600, and their whole size is reserved with
`posix_fallocate` (a sparse file on a full tmpfs kills the process that writes past the free
space with SIGBUS). Every attach opens the directory and the file with `O_NOFOLLOW` and checks,
on the open descriptors, that both are ours and private (`UnsafeSharedMemory` otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from dss.errors import (
    TierUnavailable,
    UnsafeSharedMemory,
)

log = logging.getLogger("dss.pages.host")

SHM_DIR = Path("/dev/shm")
CAPACITY_SETTING = "DSS_STORE__HOST_CAPACITY_BYTES (host_capacity_bytes)"
DIR_MODE = 0o700
FILE_MODE = 0o600
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_base() -> Path:
    """Where tiers make their directories when none is configured."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def free_bytes(path: Path | int) -> int:
    st = os.fstatvfs(path) if isinstance(path, int) else os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_dir(st: os.stat_result, path: Path | str) -> None:
    """A directory we may keep (or find) arenas in: ours and 0700, or a sticky directory of ours or
    root's (like /dev/shm itself), where other users can add files but never rename or remove
    ours. Anything else lets another user swap the file under a name we hand out."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedMemory(f"{path} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid() and mode == DIR_MODE:
        return
    if st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0):
        return
    raise UnsafeSharedMemory(
        f"shared-memory directory {path} is owned by uid {st.st_uid} with mode {oct(mode)}: "
        f"expected ours with mode {oct(DIR_MODE)} (or a sticky directory)"
    )


def check_file(st: os.stat_result, path: Path | str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeSharedMemory(f"host arena {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode != FILE_MODE:
        raise UnsafeSharedMemory(
            f"host arena {path} is owned by uid {st.st_uid} with mode {oct(mode)}: "
            f"expected ours with mode {oct(FILE_MODE)}"
        )


def open_dir(path: Path) -> int:
    """The directory opened without following a symlink, after `check_dir` on the descriptor."""
    try:
        fd = os.open(path, OPEN_DIR)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeSharedMemory(f"shared-memory directory {path} is a symbolic link") from exc
        raise TierUnavailable(f"cannot open shared-memory directory {path}: {exc.strerror or exc}") from exc
    try:
        check_dir(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_base(base: Path) -> None:
    """The directory tiers make theirs in: must exist (it is made 0700 when it does not), be a
    directory, and let no other user remove what we put in it."""
    if not base.exists():
        try:
            base.mkdir(mode=DIR_MODE, parents=True)
        except FileExistsError:
            pass  # made meanwhile: checked below like any existing one
        except OSError as exc:
            why = exc.strerror or exc
            raise TierUnavailable(f"cannot create shared-memory directory {base}: {why}") from exc
    try:
        st = os.stat(base)  # following symlinks: /dev/shm may be one; what it names is checked
    except OSError as exc:
        raise TierUnavailable(f"cannot use shared-memory directory {base}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedMemory(f"shared-memory base {base} is not a directory")
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (os.geteuid(), 0) or (others_write and not st.st_mode & stat.S_ISVTX):
        raise UnsafeSharedMemory(
            f"shared-memory base {base} (uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}) lets "
            "other users replace what is in it: use a directory of ours, or a sticky one like /dev/shm"
        )


def make_private_dir(base: Path) -> Path:
    """A new directory, ours alone, under an unguessable name (exclusive: never an existing one)."""
    check_base(base)
    path = base / f"dss-{os.getpid()}-{secrets.token_hex(16)}"
    try:
        os.mkdir(path, DIR_MODE)  # fails on anything already there, a symlink included
    except OSError as exc:
        raise TierUnavailable(f"cannot create shared-memory directory {path}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(path, OPEN_DIR)
        try:
            os.fchmod(fd, DIR_MODE)  # the umask may have taken bits off
            check_dir(os.fstat(fd), path)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return path


def remove_private_dir(path: Path) -> bool:
    """Remove a directory a tier made (a crashed owner's, named in its record), with the files in
    it, if it is still ours: never through a symlink, never another user's. True when removed."""
    try:
        fd = os.open(path, OPEN_DIR)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("not removing shared-memory directory %s: %s", path, exc.strerror or exc)
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            log.warning("not removing shared-memory directory %s: it is not ours", path)
            return False
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError as exc:
                log.warning("cannot remove %s/%s: %s", path, name, exc.strerror or exc)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError as exc:
        log.warning("cannot remove shared-memory directory %s: %s", path, exc.strerror or exc)
        return False
    return True


def remove_recorded(record: Path) -> None:
    """Remove the directory a previous tier with this record made, if it is still there."""
    try:
        text = record.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot read %s: %s", record, exc.strerror or exc)
        return
    if text and remove_private_dir(Path(text)):
        log.info("removed shared-memory directory %s left by a previous owner", text)
    with contextlib.suppress(OSError):
        record.unlink()


def write_record(record: Path, directory: Path) -> None:
    tmp = record.with_name(f".{record.name}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, str(directory).encode("utf-8"))
        finally:
            os.close(fd)
        os.replace(tmp, record)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        remove_private_dir(directory)
        raise TierUnavailable(f"cannot write {record}: {exc.strerror or exc}") from exc
