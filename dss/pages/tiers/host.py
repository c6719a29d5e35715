"""The host tier: pages in fixed-size slots of shared-memory files that other processes map.

A `HostArena` is one file of `n_slots` slots of `slot_nbytes` bytes in a shared-memory directory,
mapped with `mmap`. The owner (`HostTier`) decides which slot holds which page; another process
(the engine's worker) attaches the same file by its picklable `ArenaInfo` and copies slot bytes
to and from KV blocks directly, so page bytes never travel through a socket.

Slots are handed out in two steps so a writer in another process can fill one before anybody
can read it: `reserve` gives a slot nobody else uses and the writer fills it. The page store
(`dss.pages.manager`) keeps its pages in reserved slots and names them by `SlotRef` in its own
page table; `publish`/`get`/`delete` by page hash are a small keyed layer for tools and tests.
A slot is zeroed before it is free again: erased data must not linger in shared memory.

Lock: `HostTier._lock` is a leaf guarding slot bookkeeping only; zeroing and copying run outside
it, on slots that are reserved (so nobody else can take them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dss.errors import CapacityError, InvalidInput, PageMissing, StoreClosed, TierUnavailable
from dss.pages.tiers.base import IndexedTier
from dss.types import Buffer, PageHash, Tier
from dss.wire import ArenaInfo, SlotRef

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")


def default_directory() -> Path:
    base = SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"dss-{os.getpid()}-{secrets.token_hex(4)}"


def _cudart(torch: Any) -> Any:
    """torch's CUDA runtime bindings (untyped, hence Any)."""
    return torch.cuda.cudart()


class HostArena:
    """A shared-memory file of fixed-size slots, mapped read-write."""

    def __init__(self, info: ArenaInfo, fd: int, owner: bool) -> None:
        self.info = info
        self.owner = owner
        try:
            self._mmap = mmap.mmap(
                fd, info.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps the file alive
        # One numpy array over the whole mapping; every view is a slice of it, so the mapping has a
        # single buffer export to account for at close.
        self._array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self._pinned_ptr: int | None = None

    @classmethod
    def create(cls, path: Path | str, slot_nbytes: int, n_slots: int) -> HostArena:
        if slot_nbytes <= 0 or n_slots <= 0:
            raise InvalidInput("an arena needs a positive slot size and slot count")
        path = Path(path)
        info = ArenaInfo(str(path), slot_nbytes, n_slots)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TierUnavailable(f"cannot create host arena {path}: {exc.strerror or exc}") from exc
        try:
            os.ftruncate(fd, info.nbytes)  # sparse: memory is used only by slots that are written
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise TierUnavailable(f"cannot size host arena {path}: {exc.strerror or exc}") from exc
        return cls(info, fd, owner=True)

    @classmethod
    def attach(cls, path: Path | str, slot_nbytes: int, n_slots: int) -> HostArena:
        info = ArenaInfo(str(path), slot_nbytes, n_slots)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TierUnavailable(f"cannot attach host arena {path}: {exc.strerror or exc}") from exc
        size = os.fstat(fd).st_size
        if size != info.nbytes:
            os.close(fd)
            raise InvalidInput(f"host arena {path} has {size} bytes, expected {n_slots} x {slot_nbytes}")
        return cls(info, fd, owner=False)

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

    def pin(self) -> None:
        """Register the mapping with CUDA as page-locked memory, for fast async copies."""
        import torch

        if self._pinned_ptr is not None:
            return
        ptr = int(self._base().ctypes.data)
        err = _cudart(torch).cudaHostRegister(ptr, self.info.nbytes, 0)
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
        self._array = None
        # Views handed out earlier still export the buffer; then the mapping is released when the
        # last of them is garbage-collected instead of now (close() would raise BufferError).
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.info.path)


@dataclass(slots=True)
class _ArenaSlots:
    """Owner-side allocation state of one arena."""

    arena: HostArena
    high_water: int = 0  # slots [high_water, n_slots) were never used
    free: deque[int] = field(default_factory=deque)
    reserved: set[int] = field(default_factory=set)

    def take(self) -> int | None:
        if self.free:
            # LIFO: a recently freed slot is likely still resident (and zeroed) memory.
            return self.free.pop()
        if self.high_water < self.arena.n_slots:
            self.high_water += 1
            return self.high_water - 1
        return None


class HostTier(IndexedTier):
    """Pages in shared-memory arenas, one arena per page size, within a global byte capacity."""

    tier = Tier.HOST

    def __init__(
        self, capacity_bytes: int, directory: Path | None = None, pin_memory: bool | None = None
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidInput("capacity must not be negative")
        self.capacity_bytes = capacity_bytes
        self._own_directory = directory is None
        self.directory = Path(directory) if directory is not None else default_directory()
        self._pin = self._want_pinning(pin_memory)
        self._lock = threading.Lock()
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
        """Caller holds the lock."""
        if self._closed:
            raise StoreClosed("host tier is closed")
        slots = self._arenas.get(slot_nbytes)
        if slots is None:
            n_slots = self.capacity_bytes // slot_nbytes
            if n_slots == 0:
                raise CapacityError(f"a {slot_nbytes}-byte page exceeds the host tier capacity")
            path = self.directory / f"arena-{slot_nbytes}.shm"
            arena = HostArena.create(path, slot_nbytes, n_slots)
            if self._pin:
                try:
                    arena.pin()
                except TierUnavailable:
                    arena.close()
                    arena.unlink()
                    raise
            slots = self._arenas[slot_nbytes] = _ArenaSlots(arena)
        return slots

    def arena_info(self, slot_nbytes: int) -> ArenaInfo:
        with self._lock:
            return self._slots_for(slot_nbytes).arena.info

    def arena(self, slot_nbytes: int) -> HostArena:
        with self._lock:
            return self._slots_for(slot_nbytes).arena

    def _arena_of(self, ref: SlotRef) -> _ArenaSlots:
        """Caller holds the lock."""
        slots = self._arenas.get(ref.slot_nbytes)
        if slots is None or slots.arena.info.path != ref.path:
            raise InvalidInput(f"slot {ref} is not in this host tier")
        return slots

    # --- slots --------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> SlotRef:
        """A slot only the caller uses until it publishes or releases it."""
        if nbytes <= 0:
            raise InvalidInput("page size must be positive")
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:
                raise CapacityError(
                    f"host tier full: {self._used} of {self.capacity_bytes} bytes used, {nbytes} asked"
                )
            slots = self._slots_for(nbytes)
            slot = slots.take()
            if slot is None:
                raise CapacityError(f"host arena for {nbytes}-byte pages has no free slot")
            slots.reserved.add(slot)
            self._used += nbytes
            return SlotRef(slots.arena.info.path, nbytes, slot, slots.arena.info.n_slots)

    def publish(self, page: PageHash, ref: SlotRef) -> SlotRef:
        """Make a filled reservation visible as `page`; returns the slot that now holds the page.

        If the page is already present (same hash = same bytes), the new reservation is released
        and the existing slot is returned.
        """
        with self._lock:
            slots = self._arena_of(ref)
            if ref.slot not in slots.reserved:
                raise InvalidInput(f"slot {ref.slot} is not reserved")
            existing = self._pages.get(page)
            if existing is None:
                slots.reserved.discard(ref.slot)
                self._pages[page] = ref
                return ref
        self.release(ref)
        return existing

    def release(self, ref: SlotRef) -> None:
        """Give back a reserved slot (the page store keeps its pages in reserved slots and frees
        them here). It may hold a page or a partial copy of one: it is zeroed like a deleted page,
        outside the lock: the slot is still reserved, so it is the caller's alone until freed."""
        with self._lock:
            slots = self._arena_of(ref)
            if ref.slot not in slots.reserved:
                raise InvalidInput(f"slot {ref.slot} is not reserved")
        slots.arena.numpy(ref.slot).fill(0)
        with self._lock:
            self._release_locked(slots, ref)

    def _release_locked(self, slots: _ArenaSlots, ref: SlotRef) -> None:
        """Caller holds the lock and has zeroed the slot (outside the lock)."""
        slots.reserved.discard(ref.slot)
        slots.free.append(ref.slot)
        self._used -= ref.slot_nbytes

    def slot_array(self, ref: SlotRef) -> np.ndarray:
        """The slot's bytes as a writable uint8 array over shared memory (zero copy)."""
        with self._lock:
            arena = self._arena_of(ref).arena
        return arena.numpy(ref.slot)

    def arena_view(self, ref: SlotRef) -> memoryview:
        """The slot's bytes as a writable memoryview over shared memory (zero copy)."""
        return self.slot_array(ref).data

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

    def get_array(self, page: PageHash) -> np.ndarray:
        return np.frombuffer(self.get(page), dtype=np.uint8)

    def slot_of(self, page: PageHash) -> SlotRef | None:
        with self._lock:
            return self._pages.get(page)

    def delete(self, page: PageHash) -> int:
        with self._lock:
            ref = self._pages.pop(page, None)
            if ref is None:
                return 0
            slots = self._arena_of(ref)
            slots.reserved.add(ref.slot)  # unreachable by others until zeroed and freed
        # Zeroing (a memset of up to a few MB) runs outside the lock; the slot is ours alone.
        slots.arena.numpy(ref.slot).fill(0)
        with self._lock:
            slots.reserved.discard(ref.slot)
            slots.free.append(ref.slot)
            self._used -= ref.slot_nbytes
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
        """Every reserved slot (the page store's pages live there), for `check()`."""
        with self._lock:
            return {
                SlotRef(s.arena.info.path, size, slot, s.arena.info.n_slots)
                for size, s in self._arenas.items()
                for slot in s.reserved
            }

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
                assert len(published) + len(slots.reserved) + len(free) == slots.high_water
                used += size * (len(published) + len(slots.reserved))
            assert used == self._used, f"used bytes {self._used} != {used} in slots"
            assert self._used <= self.capacity_bytes

    def close(self) -> None:
        """Unmap and unlink every arena (and the directory, when this tier made it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            arenas = [s.arena for s in self._arenas.values()]
            self._arenas.clear()
            self._pages.clear()
            self._used = 0
        for arena in arenas:
            arena.close()
            arena.unlink()
        if self._own_directory:
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
