"""`HostTier`: the owner's slot allocator over its arenas (one per slot size), and the keyed layer
by page hash.

Slots are handed out in two steps so a writer in another process can fill one before anybody
can read it: `reserve` gives a slot nobody else uses and the writer fills it. The page store
(`dss.pages.placement`) keeps its pages in reserved slots and names them by `SlotRef` in its own
page table; `publish`/`get`/`delete` by page hash are a small keyed layer for tools and tests.
A slot is zeroed before it is free again: erased data must not linger in shared memory.

Lock: `HostTier._lock` is a leaf guarding slot bookkeeping (and the generation numbers, which only
the owner writes); zeroing, copying and creating arena files run outside it, on slots that are
reserved (so nobody else can take them) or arenas not yet visible.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from dss.errors import (
    CapacityError,
    InvalidInput,
    PageMissing,
    SharedMemoryFull,
    StoreClosed,
    TierUnavailable,
)
from dss.pages.tiers.base import IndexedTier
from dss.pages.tiers.host.arena import HostArena
from dss.pages.tiers.host.shm import (
    CAPACITY_SETTING,
    check_base,
    default_base,
    free_bytes,
    make_private_dir,
    remove_private_dir,
    remove_recorded,
    write_record,
)
from dss.types import Buffer, PageHash, Tier
from dss.wire import SlotRef

log = logging.getLogger("dss.pages.host")


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
            remove_recorded(record)
        check_base(base)
        free = free_bytes(base)
        if capacity_bytes > free:
            raise SharedMemoryFull(
                f"host tier capacity of {capacity_bytes} bytes does not fit in {base}: {free} bytes free; "
                f"lower {CAPACITY_SETTING} or give {base} more room (docker: --shm-size)"
            )
        self.base = base
        self.directory = make_private_dir(base)
        if record is not None:
            write_record(record, self.directory)
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
    def prepare(self, slot_nbytes: int) -> None:
        """Make the arena for pages of `slot_nbytes` now (`Store.prepare_pages`, at a server's
        start), rather than in the first save. A page larger than the tier is left for the save
        to refuse."""
        with contextlib.suppress(CapacityError):
            self._slots_for(slot_nbytes)

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
        if (full := self._room_error_locked(nbytes)) is not None:
            raise full

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
