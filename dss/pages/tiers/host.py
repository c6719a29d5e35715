"""The host tier: pages in fixed-size slots of shared-memory files that other processes map.

A `HostArena` is one file of `n_slots` slots of `slot_nbytes` bytes in a shared-memory directory,
mapped with `mmap`. The owner (`HostTier`) decides which slot holds which page; another process
(the engine's worker, the page-codec helpers) attaches the same file by its path and copies slot
bytes to and from KV blocks directly, so page bytes never travel through a socket.

Slots are handed out in two steps so a writer in another process can fill one before anybody
can read it: `reserve` gives a slot nobody else uses and the writer fills it. The page store
(`dss.pages.manager`) keeps its pages in reserved slots and names them by `SlotRef` in its own
page table; `publish`/`get`/`delete` by page hash are a small keyed layer for tools and tests.
A slot is zeroed before it is free again: erased data must not linger in shared memory.

Files. Every tier makes its own directory, `dss-<pid>-<128 random bits>`, with one exclusive
`mkdir(0o700)` in the shared-memory base (`/dev/shm`): nothing another local user planted there (a
directory, a symlink) can be taken for ours, and the name cannot be guessed ahead of time. Arena
files are created `O_EXCL | O_NOFOLLOW`, mode 0600, and their whole size is reserved with
`posix_fallocate` (a sparse file on a full tmpfs kills the process that writes past the free
space with SIGBUS). Every attach opens the directory and the file with `O_NOFOLLOW` and checks,
on the open descriptors, that both are ours and private (`UnsafeSharedMemory` otherwise).

Layout of an arena file: a header (magic, slot size, slot count), the slots' generation numbers
(one uint64 per slot, from byte 64), then the slots from a page-aligned offset. A slot's
generation changes whenever the page in it stops being valid (release, delete, scrub), always
before its bytes change; a `SlotRef` carries the generation it was handed out with, and a reader
in another process that copied a slot compares the two afterwards (`HostArena.unchanged`).

Lock: `HostTier._lock` is a leaf guarding slot bookkeeping (and the generation numbers, which only
the owner writes); zeroing, copying and creating arena files run outside it, on slots that are
reserved (so nobody else can take them) or arenas not yet visible.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dss.errors import (
    CapacityError,
    InvalidInput,
    PageMissing,
    SharedMemoryFull,
    StoreClosed,
    TierUnavailable,
    UnsafeSharedMemory,
)
from dss.pages.tiers.base import IndexedTier
from dss.types import Buffer, PageHash, Tier
from dss.wire import ArenaInfo, SlotRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dss.pages.host")

SHM_DIR = Path("/dev/shm")
CAPACITY_SETTING = "DSS_STORE__HOST_CAPACITY_BYTES (host_capacity_bytes)"

_DIR_MODE = 0o700
_FILE_MODE = 0o600
_MAGIC = b"DSSARN01"
_HEADER = struct.Struct("<8sQQQ")  # magic, slot_nbytes, n_slots, data_offset
_GENERATIONS_AT = 64  # byte offset of the uint64 generation array (8-byte aligned: atomic loads)
_DATA_ALIGN = 4096  # slots start page-aligned (page-locked registration, DMA)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_base() -> Path:
    """Where tiers make their directories when none is configured."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def arena_layout(slot_nbytes: int, n_slots: int) -> tuple[int, int]:
    """(offset of slot 0, file size) of an arena."""
    data_offset = -(-(_GENERATIONS_AT + 8 * n_slots) // _DATA_ALIGN) * _DATA_ALIGN
    return data_offset, data_offset + slot_nbytes * n_slots


def _cudart(torch: Any) -> Any:
    """torch's CUDA runtime bindings (untyped, hence Any)."""
    return torch.cuda.cudart()


def _free_bytes(path: Path | int) -> int:
    st = os.fstatvfs(path) if isinstance(path, int) else os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _check_dir(st: os.stat_result, path: Path | str) -> None:
    """A directory we may keep (or find) arenas in: ours and 0700, or a sticky directory of ours or
    root's (like /dev/shm itself), where other users can add files but never rename or remove
    ours. Anything else lets another user swap the file under a name we hand out."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedMemory(f"{path} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid() and mode == _DIR_MODE:
        return
    if st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0):
        return
    raise UnsafeSharedMemory(
        f"shared-memory directory {path} is owned by uid {st.st_uid} with mode {oct(mode)}: "
        f"expected ours with mode {oct(_DIR_MODE)} (or a sticky directory)"
    )


def _check_file(st: os.stat_result, path: Path | str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeSharedMemory(f"host arena {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode != _FILE_MODE:
        raise UnsafeSharedMemory(
            f"host arena {path} is owned by uid {st.st_uid} with mode {oct(mode)}: "
            f"expected ours with mode {oct(_FILE_MODE)}"
        )


def _open_dir(path: Path) -> int:
    """The directory opened without following a symlink, after `_check_dir` on the descriptor."""
    try:
        fd = os.open(path, _OPEN_DIR)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeSharedMemory(f"shared-memory directory {path} is a symbolic link") from exc
        raise TierUnavailable(f"cannot open shared-memory directory {path}: {exc.strerror or exc}") from exc
    try:
        _check_dir(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_base(base: Path) -> None:
    """The directory tiers make theirs in: must exist (it is made 0700 when it does not), be a
    directory, and let no other user remove what we put in it."""
    if not base.exists():
        try:
            base.mkdir(mode=_DIR_MODE, parents=True)
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


def _make_private_dir(base: Path) -> Path:
    """A new directory, ours alone, under an unguessable name (exclusive: never an existing one)."""
    _check_base(base)
    path = base / f"dss-{os.getpid()}-{secrets.token_hex(16)}"
    try:
        os.mkdir(path, _DIR_MODE)  # fails on anything already there, a symlink included
    except OSError as exc:
        raise TierUnavailable(f"cannot create shared-memory directory {path}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(path, _OPEN_DIR)
        try:
            os.fchmod(fd, _DIR_MODE)  # the umask may have taken bits off
            _check_dir(os.fstat(fd), path)
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
        fd = os.open(path, _OPEN_DIR)
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
        dir_fd = _open_dir(path.parent)
        try:
            try:
                fd = os.open(
                    path.name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    _FILE_MODE,
                    dir_fd=dir_fd,
                )
            except OSError as exc:
                raise TierUnavailable(f"cannot create host arena {path}: {exc.strerror or exc}") from exc
            try:
                os.fchmod(fd, _FILE_MODE)  # the umask may have taken bits off
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
        dir_fd = _open_dir(path.parent)
        try:
            try:
                before = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                raise TierUnavailable(f"cannot attach host arena {path}: {exc.strerror or exc}") from exc
            if stat.S_ISLNK(before.st_mode):
                raise UnsafeSharedMemory(f"host arena {path} is a symbolic link")
            _check_file(before, path)  # before opening: a FIFO or device is never opened
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
            _check_file(st, path)
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
        free = _free_bytes(fd)
        raise SharedMemoryFull(
            f"cannot reserve {size} bytes of shared memory for host arena {path} "
            f"({exc.strerror or exc}; {free} bytes free in {path.parent}): "
            f"lower {CAPACITY_SETTING} or give the filesystem more room"
        ) from None


@dataclass(slots=True)
class _ArenaSlots:
    """Owner-side allocation state of one arena."""

    arena: HostArena
    high_water: int = 0  # slots [high_water, n_slots) were never used
    free: deque[int] = field(default_factory=deque)
    reserved: set[int] = field(default_factory=set)
    scrubbed: set[int] = field(default_factory=set)  # reserved, zeroed at their current generation

    def take(self) -> int | None:
        if self.free:
            # LIFO: a recently freed slot is likely still resident (and zeroed) memory.
            return self.free.pop()
        if self.high_water < self.arena.n_slots:
            self.high_water += 1
            return self.high_water - 1
        return None


class HostTier(IndexedTier):
    """Pages in shared-memory arenas, one arena per page size, within a global byte capacity.

    `directory`: the base the tier makes its own private directory in (default `/dev/shm`).
    `record`: a file in a private directory (the store's run directory) naming the directory this
    tier made; the next tier given the same record removes what a crashed owner left behind,
    since names are unguessable and cannot be found again otherwise.
    """

    tier = Tier.HOST

    def __init__(
        self,
        capacity_bytes: int,
        directory: Path | None = None,
        pin_memory: bool | None = None,
        record: Path | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidInput("capacity must not be negative")
        self.capacity_bytes = capacity_bytes
        base = Path(directory) if directory is not None else default_base()
        self._pin = self._want_pinning(pin_memory)
        self._record = record
        if record is not None:
            _remove_recorded(record)
        _check_base(base)
        free = _free_bytes(base)
        if capacity_bytes > free:
            raise SharedMemoryFull(
                f"host tier capacity of {capacity_bytes} bytes does not fit in {base}: {free} bytes free; "
                f"lower {CAPACITY_SETTING} or give {base} more room (docker: --shm-size)"
            )
        self.base = base
        self.directory = _make_private_dir(base)
        if record is not None:
            _write_record(record, self.directory)
        self._lock = threading.Lock()
        self._arena_made = threading.Condition(self._lock)  # notified when an arena is installed
        self._creating: set[int] = set()  # slot sizes whose arena is being made (outside the lock)
        self._arenas: dict[int, _ArenaSlots] = {}  # by slot size
        self._pages: dict[PageHash, SlotRef] = {}
        self._used = 0  # bytes of reserved and published slots
        self._closed = False

    @staticmethod
    def _want_pinning(pin_memory: bool | None) -> bool:
        if pin_memory is False:
            return False
        import torch

        available = torch.cuda.is_available()
        if pin_memory and not available:
            raise TierUnavailable("pin_memory=True needs CUDA, which is not available")
        return available

    # --- arenas -------------------------------------------------------------------------------
    def _slots_for(self, slot_nbytes: int) -> _ArenaSlots:
        """The arena for a slot size, made on first use. Making one reserves up to the capacity
        in the filesystem (seconds for GiBs), so it runs outside the lock; callers of the same
        size wait for it instead of making a second one."""
        with self._lock:
            while True:
                if self._closed:
                    raise StoreClosed("host tier is closed")
                slots = self._arenas.get(slot_nbytes)
                if slots is not None:
                    return slots
                if slot_nbytes not in self._creating:
                    break
                self._arena_made.wait()
            n_slots = self.capacity_bytes // slot_nbytes
            if n_slots == 0:
                raise CapacityError(f"a {slot_nbytes}-byte page exceeds the host tier capacity")
            self._creating.add(slot_nbytes)
        arena: HostArena | None = None
        try:
            arena = HostArena.create(self.directory / f"arena-{slot_nbytes}.shm", slot_nbytes, n_slots)
            if self._pin:
                try:
                    arena.pin()
                except TierUnavailable:
                    arena.close()
                    arena.unlink()
                    arena = None
                    raise
        finally:
            with self._lock:
                self._creating.discard(slot_nbytes)
                if arena is not None:  # installed even when closed meanwhile: close() removes it
                    slots = self._arenas[slot_nbytes] = _ArenaSlots(arena)
                self._arena_made.notify_all()
                closed = self._closed
        if closed:
            raise StoreClosed("host tier is closed")
        return slots

    def arena(self, slot_nbytes: int) -> HostArena:
        return self._slots_for(slot_nbytes).arena

    def _arena_of(self, ref: SlotRef) -> _ArenaSlots:
        """Caller holds the lock."""
        slots = self._arenas.get(ref.slot_nbytes)
        if slots is None or slots.arena.info.path != ref.path:
            raise InvalidInput(f"slot {ref} is not in this host tier")
        return slots

    def _reserved_ref(self, ref: SlotRef) -> _ArenaSlots:
        """Caller holds the lock: `ref` names a reserved slot at its current generation (a stale
        ref, one the slot was released under, would free or publish somebody else's slot)."""
        slots = self._arena_of(ref)
        if ref.slot not in slots.reserved:
            raise InvalidInput(f"slot {ref.slot} is not reserved")
        current = slots.arena.generation(ref.slot)
        if ref.generation != current:
            raise InvalidInput(f"slot {ref.slot} is at generation {current}, not {ref.generation}")
        return slots

    # --- slots --------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> SlotRef:
        """A slot only the caller uses until it publishes or releases it."""
        if nbytes <= 0:
            raise InvalidInput("page size must be positive")
        with self._lock:
            self._check_room_locked(nbytes)  # before making an arena: a full tier makes none
        slots = self._slots_for(nbytes)
        with self._lock:
            self._check_room_locked(nbytes)
            slot = slots.take()
            if slot is None:
                raise CapacityError(f"host arena for {nbytes}-byte pages has no free slot")
            slots.reserved.add(slot)
            self._used += nbytes
            return slots.arena.ref(slot)

    def _check_room_locked(self, nbytes: int) -> None:
        if self._closed:
            raise StoreClosed("host tier is closed")
        if self._used + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"host tier full: {self._used} of {self.capacity_bytes} bytes used, {nbytes} asked"
            )

    def publish(self, page: PageHash, ref: SlotRef) -> SlotRef:
        """Make a filled reservation visible as `page`; returns the slot that now holds the page.

        If the page is already present (same hash = same bytes), the new reservation is released
        and the existing slot is returned.
        """
        with self._lock:
            slots = self._reserved_ref(ref)
            existing = self._pages.get(page)
            if existing is None:
                slots.reserved.discard(ref.slot)
                slots.scrubbed.discard(ref.slot)
                self._pages[page] = ref
                return ref
        self.release(ref)
        return existing

    def scrub(self, ref: SlotRef) -> SlotRef:
        """Invalidate and zero a reserved slot that stays reserved (a page's slot whose freeing
        waits for readers' leases to end): readers holding `ref` see a new generation, and erased
        bytes are gone now. Returns the ref at the new generation, for `release` later."""
        with self._lock:
            slots = self._reserved_ref(ref)
            generation = slots.arena.bump(ref.slot)  # before the bytes change
            slots.scrubbed.discard(ref.slot)
        slots.arena.numpy(ref.slot).fill(0)  # outside the lock: the slot is still ours alone
        with self._lock:
            slots.scrubbed.add(ref.slot)
        return replace(ref, generation=generation)

    def release(self, ref: SlotRef) -> None:
        """Give back a reserved slot (the page store keeps its pages in reserved slots and frees
        them here). It may hold a page or a partial copy of one: its generation moves on (readers
        holding `ref` see it) and it is zeroed like a deleted page, outside the lock (the slot is
        still reserved, so it is the caller's alone until freed), unless `scrub` did both."""
        with self._lock:
            slots = self._reserved_ref(ref)
            clean = ref.slot in slots.scrubbed
            if not clean:
                slots.arena.bump(ref.slot)
        if not clean:
            slots.arena.numpy(ref.slot).fill(0)
        with self._lock:
            self._free_locked(slots, ref)

    def _free_locked(self, slots: _ArenaSlots, ref: SlotRef) -> None:
        """Caller holds the lock and has bumped and zeroed the slot."""
        slots.reserved.discard(ref.slot)
        slots.scrubbed.discard(ref.slot)
        slots.free.append(ref.slot)
        self._used -= ref.slot_nbytes

    def slot_array(self, ref: SlotRef) -> np.ndarray:
        """The slot's bytes as a writable uint8 array over shared memory (zero copy)."""
        with self._lock:
            arena = self._arena_of(ref).arena
        return arena.numpy(ref.slot)

    def current(self, ref: SlotRef) -> bool:
        """Whether the slot is still at `ref`'s generation (nobody released or reused it since)."""
        with self._lock:
            arena = self._arena_of(ref).arena
        return arena.unchanged((ref.slot,), (ref.generation,)) == 1

    # --- pages --------------------------------------------------------------------------------
    def put(self, page: PageHash, data: Buffer | np.ndarray) -> SlotRef:
        with self._lock:
            existing = self._pages.get(page)
        if existing is not None:
            return existing
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        src = src.view(np.uint8)
        ref = self.reserve(src.size)
        try:
            # The copy runs outside the lock: the reserved slot is ours alone.
            np.copyto(self.slot_array(ref), src)
        except BaseException:
            self.release(ref)
            raise
        return self.publish(page, ref)

    def get(self, page: PageHash) -> memoryview:
        """The page's slot, zero copy. Valid until the page is deleted: the caller pins it first."""
        with self._lock:
            ref = self._pages.get(page)
            if ref is None:
                raise PageMissing(f"page {page.hex()} is not in the host tier")
            arena = self._arena_of(ref).arena
        return arena.view(ref.slot)

    def delete(self, page: PageHash) -> int:
        with self._lock:
            ref = self._pages.pop(page, None)
            if ref is None:
                return 0
            slots = self._arena_of(ref)
            slots.reserved.add(ref.slot)  # unreachable by others until zeroed and freed
            slots.arena.bump(ref.slot)
        # Zeroing (a memset of up to a few MB) runs outside the lock; the slot is ours alone.
        slots.arena.numpy(ref.slot).fill(0)
        with self._lock:
            self._free_locked(slots, ref)
        return ref.slot_nbytes

    def _page_index(self) -> Mapping[PageHash, object]:
        return self._pages

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._used

    def reserved_slots(self) -> set[SlotRef]:
        """Every reserved slot at its current generation (the page store's pages live there), for
        `check()`."""
        with self._lock:
            return {s.arena.ref(slot) for s in self._arenas.values() for slot in s.reserved}

    def check(self) -> None:
        """Assert the allocation invariants (for tests and post-mortems)."""
        with self._lock:
            used = 0
            for size, slots in self._arenas.items():
                published = {r.slot for r in self._pages.values() if r.slot_nbytes == size}
                free = set(slots.free)
                assert len(free) == len(slots.free), "a slot is free twice"
                assert not (published & free), "a published slot is free"
                assert not (published & slots.reserved), "a published slot is reserved"
                assert not (slots.reserved & free), "a reserved slot is free"
                assert slots.scrubbed <= slots.reserved, "a scrubbed slot is not reserved"
                assert len(published) + len(slots.reserved) + len(free) == slots.high_water
                for r in self._pages.values():
                    if r.slot_nbytes == size:
                        assert slots.arena.generation(r.slot) == r.generation, "a page's slot moved on"
                used += size * (len(published) + len(slots.reserved))
            assert used == self._used, f"used bytes {self._used} != {used} in slots"
            assert self._used <= self.capacity_bytes

    def close(self) -> None:
        """Unmap and unlink every arena, remove the tier's directory and its record."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._creating:  # an arena being made is installed, then removed here
                self._arena_made.wait()
            arenas = [s.arena for s in self._arenas.values()]
            self._arenas.clear()
            self._pages.clear()
            self._used = 0
        for arena in arenas:
            arena.close()
            arena.unlink()
        if remove_private_dir(self.directory) and self._record is not None:
            with contextlib.suppress(OSError):
                self._record.unlink()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_recorded(record: Path) -> None:
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


def _write_record(record: Path, directory: Path) -> None:
    tmp = record.with_name(f".{record.name}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
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
