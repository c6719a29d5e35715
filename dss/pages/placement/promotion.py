"""Promotion: bringing a page into the host arena from the disk tier or the remote tier.

The page is claimed in the page table, a host slot reserved (evicting if needed), the file read,
decrypted and decoded straight into the slot (by the codec helper process when there is one) with
no lock held, and the result settled. Every claim is settled whatever happens: a read that fails
in any way (no room, a destroyed key, a corrupt or missing file, an unexpected error) settles the
page unchanged and frees the slot, so the page stays evictable. A corrupt page is dropped; a page
only the remote tier listed (a lookup's hint) is dropped when it cannot be read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dss.errors import CapacityError, CorruptPage, KeyDestroyed, PageMissing, StorageError, TierUnavailable
from dss.pages.encoder import CodecStarting, PageCodecProcess
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.placement.host_room import HostRoom
from dss.pages.placement.writer import DataKeyLookup
from dss.pages.table import PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import FetchedPage, RemoteTier
from dss.types import PageHash, TenantId, Tier
from dss.wire import SlotRef

log = logging.getLogger("dss.pages")

_WAIT_BUSY_S = 10.0  # how long a promotion waits for another thread's move of the same page


class Promoter:
    def __init__(
        self,
        table: PageTable,
        host: HostTier,
        disk: DiskTier | None,
        remote: RemoteTier | None,
        data_key: DataKeyLookup,
        encoder: PageCodecProcess | None,
        host_room: HostRoom,
        copies: PageCopies,
        counters: TierCounters,
    ) -> None:
        self._table = table
        self._host = host
        self._disk = disk
        self._remote = remote
        self._data_key = data_key
        self._encoder = encoder
        self._host_room = host_room
        self._copies = copies
        self._counters = counters

    def promote_to_host(self, page: PageHash, gone: list[PageHash]) -> SlotRef | None:
        """Bring a page into the host arena (from disk if needed). None when it cannot be had:
        unknown, corrupt (then dropped and counted), key destroyed, the disk tier failed, or no
        host room (everything leased). The caller holds a lease on the page."""
        claimed: PageEntry | None = None
        for _ in range(3):
            e = self._table.get(page)
            if e is None:
                return None
            if Tier.HOST in e.tiers:
                return e.host_ref
            if e.tiers == {Tier.REMOTE}:
                return self._promote_from_remote(page, gone)
            if Tier.DISK not in e.tiers or self._disk is None:
                return None
            claimed = self._table.claim(page, lambda x: Tier.HOST not in x.tiers and Tier.DISK in x.tiers)
            if claimed is not None:
                break
            self._table.wait_unbusy(page, _WAIT_BUSY_S)  # another thread is moving it
        if claimed is None:
            return None
        ref, ok, corrupt = self._read_claimed(claimed, gone)

        def add_host(e: PageEntry) -> None:
            e.tiers.add(Tier.HOST)
            e.host_ref = ref

        doomed = self._table.settle(page, add_host if ok else None)
        if doomed is not None:
            if ref is not None:
                self._host.release(ref)
            self._copies.destroy([doomed])
            return None
        if not ok:
            if ref is not None:
                self._host.release(ref)
            if corrupt:
                self._counters.count("corrupt_pages")
                gone.extend(self._copies.drop([page]))
            return None
        self._counters.count("promotions", Tier.HOST)
        self._counters.count("hits_pages", Tier.DISK)
        return ref

    def _promote_from_remote(self, page: PageHash, gone: list[PageHash]) -> SlotRef | None:
        """Read a page only the remote tier holds into a new host slot. On any failure (Redis
        unavailable, the page evicted or expired there, a value that fails its checks) the entry is
        dropped: it was only a hint from a lookup, and the engine recomputes the page."""
        remote = self._remote
        claimed = self._table.claim(page, lambda x: x.tiers == {Tier.REMOTE})
        if claimed is None:
            self._table.wait_unbusy(page, _WAIT_BUSY_S)
            e = self._table.get(page)
            return e.host_ref if e is not None and Tier.HOST in e.tiers else None
        ref: SlotRef | None = None
        ok = False
        if remote is not None:
            try:
                ref = self._host_room.reserve(claimed.meta.nbytes, gone)
                key = self._data_key(claimed.meta.tenant)
                header, _tokens, _raw = remote.read(page, key, out=self._host.slot_array(ref))
                claimed.meta.checksum = header.checksum
                self._counters.count("remote_read_bytes", n=header.file_len)
                ok = True
            except (CapacityError, KeyDestroyed):
                pass
            except CorruptPage as exc:
                self._counters.count("corrupt_pages")
                log.warning("page %s unreadable in the remote tier (%s); recomputed", page.hex()[:16], exc)
            except (PageMissing, TierUnavailable) as exc:
                self._counters.count("remote_misses")
                log.debug("page %s not read from the remote tier: %s", page.hex()[:16], exc)
            except Exception:  # the claim is settled below whatever happened here
                log.exception("page %s not read from the remote tier", page.hex()[:16])

        promoted, doomed = self._settle_from_remote(page, ref, ok, claimed.meta.checksum)
        if not promoted and not doomed:
            gone.extend(self._copies.drop([page]))
        return ref if promoted else None

    def _settle_from_remote(
        self, page: PageHash, ref: SlotRef | None, ok: bool, checksum: bytes
    ) -> tuple[bool, bool]:
        """Settle a claimed remote-only page: into host slot `ref` when its bytes are there
        (`ok`), else it stays remote-only. (promoted, doomed: erased or dropped meanwhile); a slot
        not used is given back."""

        def to_host(e: PageEntry) -> None:
            e.tiers = {Tier.HOST}
            e.host_ref = ref
            e.meta.checksum = checksum

        doomed = self._table.settle(page, to_host if ok else None) is not None
        if doomed or not ok:
            if ref is not None:
                self._host.release(ref)
            return False, doomed
        self._counters.count("promotions", Tier.HOST)
        self._counters.count("hits_pages", Tier.REMOTE)
        return True, False

    def fetch_remote(
        self,
        pages: Sequence[PageHash],
        tenant: TenantId,
        page_nbytes: int,
        *,
        stop_at_miss: bool = True,
        one_round_trip: bool = False,
        gone: list[PageHash] | None = None,
    ) -> list[FetchedPage | None]:
        """Read and verify `pages` of `tenant` from the remote tier (`RemoteTier.read_many`:
        batched, pipelined, decoded as they arrive, each straight into a host slot reserved for
        it when there is room); None for each miss. With `stop_at_miss` the list ends at the
        first miss; `one_round_trip`: every page in one batch (candidates that are mostly
        absent). Nothing when there is no remote tier or the tenant's key is destroyed. The
        caller promotes each page read (`promote_fetched`) or gives its slot back
        (`discard_fetched`); pages evicted to make room are added to `gone`."""
        remote = self._remote
        if remote is None or not pages:
            return []
        try:
            key = self._data_key(tenant)
        except KeyDestroyed:
            return []
        batch = len(pages) if one_round_trip else 0
        into = _HostSlots(self._host_room, self._host, gone if gone is not None else [])
        got = list(
            remote.read_many(
                pages, key, page_nbytes=page_nbytes, stop_at_miss=stop_at_miss, batch=batch, into=into
            )
        )
        n = sum(x.header.file_len for x in got if x is not None)
        if n:
            self._counters.count("remote_read_bytes", n=n)
        return got

    def discard_fetched(self, fetched: Sequence[FetchedPage | None]) -> None:
        """Give back the host slots of pages `fetch_remote` read that will not be promoted."""
        for f in fetched:
            if f is not None and f.slot is not None:
                self._host.release(f.slot)

    def promote_fetched(self, fetched: FetchedPage, gone: list[PageHash]) -> SlotRef | None:
        """Settle a page `fetch_remote` read into the host tier (its slot, or a copy into a new
        one), if the page table still lists it as remote-only (else it is already promoted, or
        gone: its slot is given back). None when it was not promoted; the page then stays
        remote-only (a load reads it again, or recomputes)."""
        page = fetched.page
        t0 = time.perf_counter()
        claimed = self._table.claim(page, lambda x: x.tiers == {Tier.REMOTE})
        if claimed is None:
            self.discard_fetched([fetched])
            e = self._table.get(page)
            return e.host_ref if e is not None and Tier.HOST in e.tiers else None
        ref: SlotRef | None = fetched.slot
        ok = False
        try:
            if claimed.meta.nbytes == fetched.raw.size:
                if ref is None:
                    ref = self._host_room.reserve(claimed.meta.nbytes, gone)
                    self._host.slot_array(ref)[:] = fetched.raw
                ok = True
        except (CapacityError, TierUnavailable):
            pass
        except Exception:  # the claim is settled below whatever happened here
            log.exception("page %s not promoted from a remote read", page.hex()[:16])

        promoted, _ = self._settle_from_remote(page, ref, ok, fetched.header.checksum)
        if not promoted:
            return None
        self._counters.count("remote_promote_s", n=time.perf_counter() - t0)
        return ref

    def _read_claimed(self, entry: PageEntry, gone: list[PageHash]) -> tuple[SlotRef | None, bool, bool]:
        """Decode a claimed disk page straight into a new host slot: (slot, ok, corrupt). Never
        raises: the caller settles its claim and frees the slot."""
        page = entry.meta.hash
        try:
            ref = self._host_room.reserve(entry.meta.nbytes, gone)
        except (CapacityError, TierUnavailable):  # no room, or no arena (no shared memory for it)
            return None, False, False
        except Exception:
            log.exception("no host slot for page %s", page.hex()[:16])
            return None, False, False
        try:
            key = self._data_key(entry.meta.tenant)
            self._read_file(page, key, ref)
            return ref, True, False
        except (CorruptPage, KeyDestroyed) as exc:
            log.warning("page %s unreadable on disk (%s); dropped, will be recomputed", page.hex()[:16], exc)
            return ref, False, True
        except (StorageError, OSError) as exc:  # tier unavailable, page file gone
            log.warning("disk tier read failed for %s: %s", page.hex()[:16], exc)
            return ref, False, False
        except Exception:  # e.g. the data key's database read: not had now, tried again later
            log.exception("page %s not read from disk", page.hex()[:16])
            return ref, False, False

    def _read_file(self, page: PageHash, key: bytes, ref: SlotRef) -> None:
        """Decode a page file into a slot: in the helper process when there is one (else here)."""
        disk = self._disk
        assert disk is not None
        if self._encoder is not None:
            try:
                self._encoder.decode_file(disk.path_of(page), page, key, ref, wait_start=False)
                return
            except CorruptPage:
                disk.drop_corrupt(page)
                raise
            except PageMissing:
                raise
            except CodecStarting:
                pass  # a load does not wait for a helper's start-up: decoded here meanwhile
            except TierUnavailable as exc:
                log.warning("page codec process failed (%s); decoding in this process", exc)
        disk.read(page, key, out=self._host.slot_array(ref))


class _HostSlots:
    """`ReadInto` over the host arena: a remote read decodes each page straight into a slot
    reserved for it (evicting if needed); no room is a fresh array instead."""

    def __init__(self, room: HostRoom, host: HostTier, gone: list[PageHash]) -> None:
        self._room = room
        self._host = host
        self._gone = gone

    def take(self, page: PageHash, nbytes: int) -> tuple[Any, np.ndarray] | None:
        try:
            ref = self._room.reserve(nbytes, self._gone)  # list.append: safe from reader threads
        except (CapacityError, TierUnavailable):
            return None
        return ref, self._host.slot_array(ref)

    def give_back(self, ref: Any) -> None:
        self._host.release(ref)
