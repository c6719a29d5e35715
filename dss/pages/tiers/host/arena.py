"""The host arena format: one shared-memory file of fixed-size slots that other processes map
(the engine's worker through `engine_patch.connector`, the page-codec helpers).

A `HostArena` is one file of `n_slots` slots of `slot_nbytes` bytes in a shared-memory directory,
mapped with `mmap`. The owner (`HostTier`) decides which slot holds which page; another process
(the engine's worker, the page-codec helpers) attaches the same file by its path and copies slot
bytes to and from KV blocks directly, so page bytes never travel through a socket.

Layout of an arena file: a header (magic, slot size, slot count), the slots' generation numbers
(one uint64 per slot, from byte 64), then the slots from a page-aligned offset. A slot's
generation changes whenever the page in it stops being valid (release, delete, scrub), always
before its bytes change; a `SlotRef` carries the generation it was handed out with, and a reader
in another process that copied a slot compares the two afterwards (`HostArena.unchanged`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dss.errors import (
    InvalidInput,
    SharedMemoryFull,
    StoreClosed,
    TierUnavailable,
    UnsafeSharedMemory,
)
from dss.pages.tiers.host.shm import CAPACITY_SETTING, FILE_MODE, check_file, free_bytes, open_dir
from dss.wire import ArenaInfo, SlotRef

if TYPE_CHECKING:
    import torch

_MAGIC = b"DSSARN01"
_HEADER = struct.Struct("<8sQQQ")  # magic, slot_nbytes, n_slots, data_offset
_GENERATIONS_AT = 64  # byte offset of the uint64 generation array (8-byte aligned: atomic loads)
_DATA_ALIGN = 4096  # slots start page-aligned (page-locked registration, DMA)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (`mmap.MADV_POPULATE_WRITE` from Python 3.13 on)
_PREFAULT_CHUNK = 32 << 20  # one madvise call: ~15 ms; `stop` is asked between calls


def arena_layout(slot_nbytes: int, n_slots: int) -> tuple[int, int]:
    """(offset of slot 0, file size) of an arena."""
    data_offset = -(-(_GENERATIONS_AT + 8 * n_slots) // _DATA_ALIGN) * _DATA_ALIGN
    return data_offset, data_offset + slot_nbytes * n_slots


def _cudart(torch: Any) -> Any:
    """torch's CUDA runtime bindings (untyped, hence Any)."""
    return torch.cuda.cudart()


class HostArena:
    """A shared-memory file of fixed-size slots and their generation numbers, mapped read-write."""

    def __init__(self, info: ArenaInfo, fd: int, owner: bool) -> None:
        self.info = info
        self.owner = owner
        self.data_offset, self.file_nbytes = arena_layout(info.slot_nbytes, info.n_slots)
        try:
            self.inode = os.fstat(fd).st_ino  # tells a recreated file at the same path apart
            self._mmap = mmap.mmap(
                fd, self.file_nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps the file alive
        # One numpy array over the whole mapping; every view is a slice of it, so the mapping has a
        # single buffer export to account for at close.
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        self._whole: np.ndarray | None = whole
        self._array: np.ndarray | None = whole[self.data_offset :]
        # Generations: read by every process without a lock. Only the owner writes them (under
        # `HostTier._lock`), one aligned 8-byte store per bump, which no reader can see torn. The
        # owner bumps before it zeroes or hands out the slot again, and a reader loads the
        # generation after its copy: on x86-64 (stores become visible in order, loads are not
        # reordered with earlier loads) a reader that saw any byte of new content sees the bump.
        # Elsewhere the owner's own validation (`wait_loaded`) and the lease rule (a leased page's
        # slot is never reused) remain the guarantee.
        gens = whole[_GENERATIONS_AT : _GENERATIONS_AT + 8 * info.n_slots]
        self._generations: np.ndarray | None = gens.view(np.uint64)
        self._pinned_ptr: int | None = None

    @classmethod
    def create(cls, path: Path | str, slot_nbytes: int, n_slots: int) -> HostArena:
        """A new arena file (never an existing one) in an existing private directory, its whole size
        reserved in the filesystem now (`SharedMemoryFull` when that does not fit)."""
        if slot_nbytes <= 0 or n_slots <= 0:
            raise InvalidInput("an arena needs a positive slot size and slot count")
        path = Path(path)
        info = ArenaInfo(str(path), slot_nbytes, n_slots)
        data_offset, size = arena_layout(slot_nbytes, n_slots)
        dir_fd = open_dir(path.parent)
        try:
            try:
                fd = os.open(
                    path.name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    FILE_MODE,
                    dir_fd=dir_fd,
                )
            except OSError as exc:
                raise TierUnavailable(f"cannot create host arena {path}: {exc.strerror or exc}") from exc
            try:
                os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off
                os.ftruncate(fd, size)
                _reserve(fd, size, path)
                header = _HEADER.pack(_MAGIC, slot_nbytes, n_slots, data_offset)
                os.pwrite(fd, header, 0)  # before anybody learns the path
            except BaseException as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path.name, dir_fd=dir_fd)
                if isinstance(exc, OSError):
                    raise TierUnavailable(f"cannot size host arena {path}: {exc.strerror or exc}") from exc
                raise
        finally:
            os.close(dir_fd)
        return cls(info, fd, owner=True)

    @classmethod
    def attach(cls, path: Path | str, slot_nbytes: int, n_slots: int | None = None) -> HostArena:
        """Map an existing arena (another process's). Refuses (`UnsafeSharedMemory`) a symlink,
        anything but a regular file, and a file or directory that is not ours and private; a file
        of another layout is `InvalidInput`. `n_slots` is read from the file when not given."""
        path = Path(path)
        dir_fd = open_dir(path.parent)
        try:
            try:
                before = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                raise TierUnavailable(f"cannot attach host arena {path}: {exc.strerror or exc}") from exc
            if stat.S_ISLNK(before.st_mode):
                raise UnsafeSharedMemory(f"host arena {path} is a symbolic link")
            check_file(before, path)  # before opening: a FIFO or device is never opened
            try:
                fd = os.open(path.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # swapped for a symlink since the check
                    raise UnsafeSharedMemory(f"host arena {path} is a symbolic link") from exc
                raise TierUnavailable(f"cannot attach host arena {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            check_file(st, path)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise UnsafeSharedMemory(f"host arena {path} was replaced while it was opened")
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) < _HEADER.size:
                raise InvalidInput(f"host arena {path} has {st.st_size} bytes: no arena header")
            magic, file_slot_nbytes, file_n_slots, data_offset = _HEADER.unpack(raw)
            if magic != _MAGIC:
                raise InvalidInput(f"{path} is not a host arena")
            want_slots = file_n_slots if n_slots is None else n_slots
            if (file_slot_nbytes, file_n_slots) != (slot_nbytes, want_slots):
                raise InvalidInput(
                    f"host arena {path} has {file_n_slots} x {file_slot_nbytes}-byte slots, "
                    f"expected {want_slots} x {slot_nbytes}"
                )
            if (data_offset, st.st_size) != arena_layout(slot_nbytes, want_slots):
                raise InvalidInput(f"host arena {path} has {st.st_size} bytes, not its layout's")
        except BaseException:
            os.close(fd)
            raise
        return cls(ArenaInfo(str(path), slot_nbytes, want_slots), fd, owner=False)

    @classmethod
    def attach_info(cls, info: ArenaInfo) -> HostArena:
        return cls.attach(info.path, info.slot_nbytes, info.n_slots)

    @property
    def path(self) -> Path:
        return Path(self.info.path)

    @property
    def slot_nbytes(self) -> int:
        return self.info.slot_nbytes

    @property
    def n_slots(self) -> int:
        return self.info.n_slots

    @property
    def closed(self) -> bool:
        return self._array is None

    def _base(self) -> np.ndarray:
        if self._array is None:
            raise StoreClosed(f"host arena {self.info.path} is closed")
        return self._array

    def _gens(self) -> np.ndarray:
        if self._generations is None:
            raise StoreClosed(f"host arena {self.info.path} is closed")
        return self._generations

    def data(self) -> np.ndarray:
        """Every slot, as one uint8 array of `n_slots * slot_nbytes` bytes over the mapping."""
        return self._base()

    def numpy(self, slot: int) -> np.ndarray:
        """The slot as a uint8 array sharing the mapping (zero copy)."""
        if not 0 <= slot < self.info.n_slots:
            raise InvalidInput(f"slot {slot} out of range [0, {self.info.n_slots})")
        start = slot * self.info.slot_nbytes
        return self._base()[start : start + self.info.slot_nbytes]

    def view(self, slot: int) -> memoryview:
        return self.numpy(slot).data

    def torch(self, slot: int) -> torch.Tensor:
        """The slot as a uint8 tensor sharing the mapping (zero copy)."""
        import torch

        return torch.from_numpy(self.numpy(slot))

    # --- generations ----------------------------------------------------------------------------
    def generation(self, slot: int) -> int:
        if not 0 <= slot < self.info.n_slots:
            raise InvalidInput(f"slot {slot} out of range [0, {self.info.n_slots})")
        return int(self._gens()[slot])

    def unchanged(self, slots: Sequence[int], generations: Sequence[int]) -> int:
        """How many of `slots`, from the first, still hold the generation a reader was given: call
        it after the copy; a copy past that count may hold another page's bytes and is a miss."""
        if len(slots) != len(generations):
            return 0
        gens = self._gens()
        n = 0
        for slot, want in zip(slots, generations, strict=True):
            if not 0 <= slot < self.info.n_slots or int(gens[slot]) != want:
                break
            n += 1
        return n

    def bump(self, slot: int) -> int:
        """The owner's: a new generation for the slot (before its bytes change). Returns it."""
        gens = self._gens()
        gens[slot] = gens[slot] + np.uint64(1)
        return int(gens[slot])

    def ref(self, slot: int) -> SlotRef:
        return SlotRef(self.info.path, self.info.slot_nbytes, slot, self.info.n_slots, self.generation(slot))

    # --- life cycle -----------------------------------------------------------------------------
    def prefault(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Map every slot into this process's page tables now, writable, without changing a byte
        (`madvise(MADV_POPULATE_WRITE)`), a chunk at a time, until done, the arena is closed or
        `stop()` says so. True when every slot was mapped.

        Why: a process's first write to each 4 KiB of a shared mapping is a page fault. The
        engine's worker copying a new 2,000-token prompt's pages (47 MB) into slots it had never
        touched spent 120-180 ms of an engine step in them, against ~5 ms for the copy itself;
        populating costs ~0.4 s per GiB once. Meant for a thread: each call releases the GIL
        (ctypes). A kernel older than 5.14 refuses the advice: then nothing changes (False)."""
        whole = self._whole
        if whole is None:
            return False
        # This view is a buffer export: a `close` meanwhile leaves the mapping in place until the
        # view is gone (at return), so no call below can reach memory that is not the arena's.
        data = whole[self.data_offset :]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        start, size = int(data.ctypes.data), int(data.nbytes)
        for offset in range(0, size, _PREFAULT_CHUNK):
            if self.closed or stop():
                return False
            if madvise(start + offset, min(_PREFAULT_CHUNK, size - offset), _MADV_POPULATE_WRITE) != 0:
                return False  # EINVAL: a kernel older than 5.14; whatever else: faults stay lazy
        return True

    def pin(self) -> None:
        """Register the mapping with CUDA as page-locked memory, for fast async copies."""
        import torch

        if self._pinned_ptr is not None:
            return
        if self._whole is None:
            raise StoreClosed(f"host arena {self.info.path} is closed")
        ptr = int(self._whole.ctypes.data)
        err = _cudart(torch).cudaHostRegister(ptr, self.file_nbytes, 0)
        if int(err) != 0:
            raise TierUnavailable(
                f"cudaHostRegister failed for host arena {self.info.path}: error {int(err)}"
            )
        self._pinned_ptr = ptr

    def close(self) -> None:
        if self._array is None:
            return
        if self._pinned_ptr is not None:
            import torch

            _cudart(torch).cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self._array = self._generations = self._whole = None
        # Views handed out earlier still export the buffer; then the mapping is released when the
        # last of them is garbage-collected instead of now (close() would raise BufferError).
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.info.path)


def _reserve(fd: int, size: int, path: Path) -> None:
    """Allocate the whole file now: a sparse arena on a tmpfs without room for it raises SIGBUS in
    whichever process first writes past the free space (the engine, mid-copy)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # not on this platform: the capacity check at start is all there is
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        free = free_bytes(fd)
        raise SharedMemoryFull(
            f"cannot reserve {size} bytes of shared memory for host arena {path} "
            f"({exc.strerror or exc}; {free} bytes free in {path.parent}): "
            f"lower {CAPACITY_SETTING} or give the filesystem more room"
        ) from None
