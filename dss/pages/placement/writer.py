"""Writing a claimed host page out: to the disk tier (write-through, write-back before eviction)
and to the remote tier (write-behind).

A page file is encrypted under the tenant's data key, compressed and written (by the codec helper
process when there is one), with no lock held; its row goes into the `pages` table after the file.
A failure of any kind is an outcome, never an exception: the caller holds the page's claim and
must settle it (a claim left behind would keep the page from ever being evicted). A disk full of
pages it may not evict, an unavailable disk or a destroyed key leave the page in memory only;
bytes that fail their checksum are reported so the caller drops the page.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from dss.errors import CapacityError, CorruptPage, KeyDestroyed, TierUnavailable
from dss.pages.codec import Codec
from dss.pages.encoder import CodecStarting, PageCodecProcess
from dss.pages.meta import PageMeta
from dss.pages.pagefile import encode_page
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.placement.disk_room import DiskRoom
from dss.pages.rows import PageRows
from dss.pages.table import PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import RemoteTier
from dss.types import PageHash, TenantId, Tier
from dss.wire import SlotRef

log = logging.getLogger("dss.pages")

DataKeyLookup = Callable[[TenantId], bytes]
"""Returns the tenant's data key (creating it on first use); raises KeyDestroyed after an erasure."""

_PROBE_EVERY_S = 5.0  # how often an unavailable disk tier is probed before a write
CORRUPT = -1  # `write_claimed`: the page's bytes failed their checksum


class PageWriter:
    def __init__(
        self,
        table: PageTable,
        host: HostTier,
        disk: DiskTier | None,
        remote: RemoteTier | None,
        rows: PageRows,
        data_key: DataKeyLookup,
        encoder: PageCodecProcess | None,
        disk_room: DiskRoom | None,
        copies: PageCopies,
        counters: TierCounters,
    ) -> None:
        self._table = table
        self._host = host
        self._disk = disk
        self._remote = remote
        self._rows = rows
        self._data_key = data_key
        self._encoder = encoder
        self._disk_room = disk_room
        self._copies = copies
        self._counters = counters
        self._next_probe = 0.0

    def write_through(self, page: PageHash, gone: list[PageHash]) -> bool:
        """Write-through of one host page (the background writer). False when it was not written
        (gone, already on disk, being moved, disk unavailable or full of pages in use, or the
        write failed)."""
        claimed = self._table.claim(page, lambda e: Tier.HOST in e.tiers and Tier.DISK not in e.tiers)
        if claimed is None:
            return False
        written = self.write_claimed(claimed, gone)
        if written >= 0:
            self._write_remote(claimed, written)

        def add_disk(e: PageEntry) -> None:
            e.tiers.add(Tier.DISK)
            e.disk_bytes = written

        doomed = self._table.settle(page, add_disk if written > 0 else None)
        if doomed is not None:  # erased or dropped while we wrote: our copies go too
            self._copies.destroy([doomed], extra_disk=written > 0)
            return False
        if written == CORRUPT:  # the slot's bytes no longer match their checksum: never persist or serve them
            self._counters.count("corrupt_pages")
            gone.extend(self._copies.drop([page]))
        return written > 0

    def write_claimed(self, entry: PageEntry, gone: list[PageHash]) -> int:
        """Encrypt, compress and write a page the caller claimed (no lock held). Bytes on disk; 0
        when not written; `CORRUPT` when the page's bytes failed their checksum (the caller drops
        the page). Never raises: the caller must settle its claim whatever happens here."""
        disk, meta, ref = self._disk, entry.meta, entry.host_ref
        if disk is None or ref is None:
            return 0
        if not disk.available and not self._probe(disk):
            return 0
        try:
            key = self._data_key(meta.tenant)
            written = self._write_file(disk, meta, ref, key, gone)
        except KeyDestroyed:
            return 0
        except CorruptPage as exc:
            log.error(
                "page %s changed in memory since it was stored (%s); dropped", meta.hash.hex()[:16], exc
            )
            return CORRUPT
        except TierUnavailable as exc:
            self._counters.count("disk_write_errors")
            log.error("disk tier unavailable, serving from memory only: %s", exc)
            return 0
        except CapacityError as exc:  # full of pages in use, pinned or also in memory: stays in memory
            self._counters.count("disk_full_skips")
            log.debug("page %s not written through: %s", meta.hash.hex()[:16], exc)
            return 0
        except Exception:  # e.g. the data key's database read: the page stays in memory only
            self._counters.count("disk_write_errors")
            log.exception("page %s not written to disk", meta.hash.hex()[:16])
            return 0
        if not written:
            return 0
        try:
            self._rows.add(meta, written, key)
        except Exception:
            log.exception("could not record page %s on disk; file removed", meta.hash.hex()[:16])
            disk.delete(meta.hash)
            return 0
        return written

    def _write_remote(self, entry: PageEntry, disk_bytes: int) -> None:
        """Write-behind of a claimed page to the remote tier: the disk tier's file as it is when
        one was just written (the same at-rest format), else the page encoded here. Skipped when
        Redis has it already (another server wrote it) or is unavailable; never raises."""
        remote, meta, ref = self._remote, entry.meta, entry.host_ref
        if remote is None or ref is None or not remote.config.write_behind:
            return  # (an unavailable tier fails fast below, and is tried again later)
        try:
            if remote.exists([meta.hash])[0]:
                return
            key = self._data_key(meta.tenant)
            blob: bytes | None = None
            # The disk file as it is when the remote tier keeps the same encoding (a zstd level
            # is not in the file: any level of the same codec decodes alike).
            disk = self._disk
            if disk_bytes > 0 and disk is not None and _same_encoding(disk.codec, remote.codec):
                with contextlib.suppress(OSError):
                    blob = disk.path_of(meta.hash).read_bytes()
            if blob is None:
                blob = encode_page(meta, self._host.slot_array(ref).data, remote.codec, key)
            if remote.put(meta.hash, meta.tenant, blob):
                self._counters.count("remote_writes")
        except KeyDestroyed:
            return
        except (TierUnavailable, CorruptPage) as exc:
            self._counters.count("remote_write_errors")
            log.debug("page %s not written to the remote tier: %s", meta.hash.hex()[:16], exc)
        except Exception:  # the caller settles its claim next, whatever happened here
            self._counters.count("remote_write_errors")
            log.exception("page %s not written to the remote tier", meta.hash.hex()[:16])

    def _write_file(
        self, disk: DiskTier, meta: PageMeta, ref: SlotRef, key: bytes, gone: list[PageHash]
    ) -> int:
        """The page file, encoded by the helper process when one answers (else here: it may still
        be starting, and a turn's durable wait must not wait for it); evicts disk-only pages when
        the tier is full."""
        assert self._disk_room is not None  # there is a disk tier
        if self._encoder is not None:
            tmp = disk.temp_path(meta.hash)
            try:
                size = self._encoder.encode_to_file(meta, ref, key, tmp, disk.fsync, wait_start=False)
                try:
                    return disk.adopt(meta, tmp, size)
                except CapacityError:
                    self._disk_room.make_room(size, gone)
                    return disk.adopt(meta, tmp, size)
            except CodecStarting:
                pass  # encoded here below, as without a helper
            except TierUnavailable as exc:
                if disk.available:  # the helper died, not the disk: write it here instead
                    log.warning("page codec process failed (%s); encoding in this process", exc)
                else:
                    raise
            finally:
                disk.discard_temp(tmp)
        raw = self._host.slot_array(ref).data
        try:
            return disk.write(meta, raw, key)
        except CapacityError:
            self._disk_room.make_room(meta.nbytes, gone)
            return disk.write(meta, raw, key)

    def _probe(self, disk: DiskTier) -> bool:
        """Whether an unavailable disk tier works again (a real write, at most every few seconds)."""
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + _PROBE_EVERY_S
        if disk.probe():
            log.warning("disk tier at %s is writable again", disk.root)
            return True
        return False


def _same_encoding(a: Codec, b: Codec) -> bool:
    return a.name == b.name and getattr(a, "level", None) == getattr(b, "level", None)
