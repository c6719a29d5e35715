"""The disk tier: one compressed, encrypted, checksummed file per page, written atomically.

Files live at `root/<first 2 hex of the hash>/<hash hex>.page`. A write goes to a temp file in
the same directory, is fsynced, renamed over the final name and the directory fsynced, so a
crash leaves either the whole page or a temp file that `gc_temp` removes at start-up.

When the file system refuses a write (full, read-only, permissions), the tier raises
`TierUnavailable` and marks itself unavailable: further writes fail fast until `probe()` sees
the directory writable again. Reads keep working while they can.

The tier knows the tenant of each file it wrote (`adopt`) or whose header it read (`scan`, which
recovery runs at start-up), so that an erasure's verification finds a tenant's files without
reading every header (`tenant_files`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from dss.errors import CapacityError, CorruptPage, PageMissing, TierUnavailable
from dss.files import fsync_dir
from dss.pages.codec import Codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import HEADER_LEN, PageFileHeader, decode_page_of, encode_page, read_header
from dss.pages.tiers.base import IndexedTier
from dss.types import HASH_BYTES, Buffer, PageHash, TenantId, Tier

PAGE_SUFFIX = ".page"
TEMP_MARK = ".tmp-"
_PROBE_NAME = ".probe"


def _page_from_name(name: str) -> PageHash | None:
    stem, _, suffix = name.partition(".")
    if "." + suffix != PAGE_SUFFIX or len(stem) != 2 * HASH_BYTES:
        return None
    try:
        return PageHash(bytes.fromhex(stem))
    except ValueError:
        return None


class DiskTier(IndexedTier):
    tier = Tier.DISK

    def __init__(self, root: Path, capacity_bytes: int, codec: Codec, fsync: bool = True) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.fsync = fsync
        self.available = True
        self.corrupt_pages = 0
        self._lock = threading.Lock()
        self._sizes: dict[PageHash, int] = {}
        self._used = 0
        self._pending = 0  # bytes reserved by writes in flight
        self._writing: set[str] = set()  # temp file names of this process's writes in flight
        self._known_dirs: set[str] = set()
        # The tenant of each page file whose tenant is known (written here, or its header read),
        # and the reverse. A subset of `_sizes`: a file listed at open is unclassified until
        # `scan` (or `tenant_files`) reads its header.
        self._tenant_of: dict[PageHash, TenantId] = {}
        self._files_of: dict[TenantId, set[PageHash]] = {}
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._index_at_open()
        except OSError as exc:
            self.available = False
            raise TierUnavailable(f"disk tier at {self.root} is not usable: {exc.strerror or exc}") from exc

    def _index_at_open(self) -> None:
        """Sizes of the page files present, by name only (`scan` verifies headers)."""
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            self._known_dirs.add(sub.name)
            for entry in os.scandir(sub.path):
                page = _page_from_name(entry.name)
                if page is not None and entry.name.startswith(sub.name):
                    size = entry.stat(follow_symlinks=False).st_size
                    self._sizes[page] = size
                    self._used += size

    def path_of(self, page: PageHash) -> Path:
        hexname = page.hex()
        return self.root / hexname[:2] / (hexname + PAGE_SUFFIX)

    # --- writing ------------------------------------------------------------------------------
    def write(self, meta: PageMeta, raw: Buffer, data_key: bytes | None) -> int:
        """Store the page; returns its bytes on disk. A page already present is left as is."""
        with self._lock:
            if meta.hash in self._sizes:
                return self._sizes[meta.hash]
        blob = encode_page(meta, raw, self.codec, data_key)  # CPU-bound; outside the lock
        with self._lock:
            # Checked before writing too, so a full tier costs no file write.
            full = None if meta.hash in self._sizes else self._room_error_locked(len(blob))
        if full is not None:
            raise full
        tmp = self.temp_path(meta.hash)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self.discard_temp(tmp)
            self.available = False
            raise TierUnavailable(f"disk tier cannot write {tmp}: {exc.strerror or exc}") from exc
        try:
            return self.adopt(meta, tmp, len(blob))
        except CapacityError:
            self.discard_temp(tmp)
            raise

    # --- writing in two steps (here, or from `dss.pages.encoder`) -----------------------------
    def temp_path(self, page: PageHash) -> Path:
        """A fresh temp file name next to the page's final name, for a writer in another process;
        `gc_temp` leaves it alone until `adopt` or `discard_temp`."""
        if not self.available:
            raise TierUnavailable(f"disk tier at {self.root} is unavailable (waiting for a successful probe)")
        final = self.path_of(page)
        try:
            self._ensure_dir(final.parent)
        except OSError as exc:
            self.available = False
            raise TierUnavailable(f"disk tier cannot write {final.parent}: {exc.strerror or exc}") from exc
        tmp = final.with_name(f"{final.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        with self._lock:
            self._writing.add(tmp.name)
        return tmp

    def adopt(self, meta: PageMeta, tmp: Path, size: int) -> int:
        """Make a complete (and, with fsync on, durable) temp file the page's file; returns its
        size. `CapacityError` leaves the temp file for a retry after eviction."""
        with self._lock:
            if meta.hash in self._sizes:
                existing = self._sizes[meta.hash]
            elif (full := self._room_error_locked(size)) is not None:
                raise full
            else:
                existing = None
                self._pending += size
        if existing is not None:
            self.discard_temp(tmp)
            return existing
        final = self.path_of(meta.hash)
        committed = False
        try:
            os.rename(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
            committed = True
        except OSError as exc:
            self.available = False
            raise TierUnavailable(f"disk tier cannot write {final}: {exc.strerror or exc}") from exc
        finally:
            with self._lock:
                self._pending -= size
                self._writing.discard(tmp.name)
                if committed:
                    self._used += size - self._sizes.get(meta.hash, 0)
                    self._sizes[meta.hash] = size
                    self._classify_locked(meta.hash, meta.tenant)
            if not committed:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        return size

    def discard_temp(self, tmp: Path) -> None:
        with contextlib.suppress(OSError):
            tmp.unlink()
        with self._lock:
            self._writing.discard(tmp.name)

    def _ensure_dir(self, subdir: Path) -> None:
        if subdir.name not in self._known_dirs:
            subdir.mkdir(mode=0o700, exist_ok=True)
            if self.fsync:
                fsync_dir(self.root)
            self._known_dirs.add(subdir.name)

    # --- reading ------------------------------------------------------------------------------
    def _read_bytes(self, page: PageHash, limit: int | None = None) -> bytes:
        path = self.path_of(page)
        try:
            with open(path, "rb", buffering=0) as f:
                return f.read() if limit is None else f.read(limit)
        except FileNotFoundError:
            with self._lock:
                self._used -= self._sizes.pop(page, 0)
                self._unclassify_locked(page)
            raise PageMissing(f"page {page.hex()} is not on disk") from None
        except OSError as exc:
            raise TierUnavailable(f"disk tier cannot read {path}: {exc.strerror or exc}") from exc

    def read(
        self, page: PageHash, data_key: bytes | None, out: np.ndarray | None = None
    ) -> tuple[PageFileHeader, np.ndarray, bytearray | bytes | memoryview]:
        """Verified page: (header, token ids, raw bytes). A corrupt file is deleted and counted.

        `out`, a writable uint8 array of the page's size (e.g. a reserved host-arena slot), makes
        the page decode straight into it, saving a copy on promotion.
        """
        blob = self._read_bytes(page)
        try:
            header, tokens, raw = decode_page_of(blob, page, data_key, out=out)
        except CorruptPage:
            self.drop_corrupt(page)
            raise
        return header, tokens, raw

    def read_header(self, page: PageHash) -> PageFileHeader:
        prefix = self._read_bytes(page, HEADER_LEN)
        try:
            header = read_header(prefix)
            if header.page_hash != page:
                raise CorruptPage(f"file of page {page.hex()} holds page {header.page_hash.hex()}")
        except CorruptPage:
            self.drop_corrupt(page)
            raise
        return header

    def drop_corrupt(self, page: PageHash, path: Path | None = None) -> None:
        """Count and delete a page file that failed verification."""
        with self._lock:
            self.corrupt_pages += 1
            self._used -= self._sizes.pop(page, 0)
            self._unclassify_locked(page)
        with contextlib.suppress(OSError):
            (path or self.path_of(page)).unlink()

    def scan(self) -> Iterator[tuple[PageHash, PageFileHeader, int]]:
        """Every page file with a valid header, for recovery. Bad headers are counted and deleted."""
        for sub in sorted(os.scandir(self.root), key=lambda e: e.name):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for entry in sorted(os.scandir(sub.path), key=lambda e: e.name):
                page = _page_from_name(entry.name)
                if page is None:
                    continue
                path = Path(entry.path)
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                    with open(path, "rb", buffering=0) as f:
                        prefix = f.read(HEADER_LEN)
                except FileNotFoundError:
                    continue  # deleted meanwhile
                except OSError as exc:
                    raise TierUnavailable(f"disk tier cannot read {path}: {exc.strerror or exc}") from exc
                try:
                    header = read_header(prefix)
                    if header.page_hash != page or header.file_len != size:
                        raise CorruptPage(f"page file {path} is misnamed or truncated")
                except CorruptPage:
                    self.drop_corrupt(page, path)
                    continue
                with self._lock:
                    self._used += size - self._sizes.get(page, 0)
                    self._sizes[page] = size
                    self._classify_locked(page, header.tenant)
                yield page, header, size

    def tenant_files(self, tenant: TenantId) -> list[PageHash]:
        """The page files of `tenant` on disk now, reading no header of another tenant's file the
        tier knows.

        Found: (1) every file this tier wrote for the tenant (`adopt` records the tenant, also for
        a writer that raced an erasure and landed after its rows were deleted) or classified for
        it (`scan` at start-up); (2) any file the tier does not know whose header names the
        tenant: a file copied in from outside (a restored backup), a file whose delete failed,
        or one listed at open and never scanned. (2) costs a listing of the file names (no file
        is opened) and one header read per unknown file; the classification of files the tier
        holds is kept, so each is read once. Not found: temp files of writes in flight (not
        pages yet; `gc_temp` removes leftovers) and files of another name than `<hash>.page`.
        """
        found: set[PageHash] = set()
        try:
            with os.scandir(self.root) as entries:
                subdirs = [e for e in entries if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        except OSError as exc:
            raise TierUnavailable(f"disk tier cannot list {self.root}: {exc.strerror or exc}") from exc
        for sub in subdirs:
            try:
                names = os.listdir(sub.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierUnavailable(f"disk tier cannot list {sub.path}: {exc.strerror or exc}") from exc
            pages = [p for p in map(_page_from_name, names) if p is not None]
            with self._lock:
                unknown = [p for p in pages if p not in self._tenant_of]
            for page in unknown:
                header = self._peek_header(page)
                if header is None:
                    continue
                with self._lock:
                    if page in self._sizes:  # a file the tier holds: classified from now on
                        self._classify_locked(page, header.tenant)
                if header.tenant == tenant:
                    found.add(page)
        with self._lock:
            found |= self._files_of.get(tenant, set())
        return sorted(found)

    def _peek_header(self, page: PageHash) -> PageFileHeader | None:
        """The header of `page`'s file, or None when it is gone or not a page file's (verification
        only looks: recovery is what removes bad files)."""
        path = self.path_of(page)
        try:
            with open(path, "rb", buffering=0) as f:
                prefix = f.read(HEADER_LEN)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailable(f"disk tier cannot read {path}: {exc.strerror or exc}") from exc
        try:
            header = read_header(prefix)
        except CorruptPage:
            return None
        return header if header.page_hash == page else None

    def _classify_locked(self, page: PageHash, tenant: TenantId) -> None:
        old = self._tenant_of.get(page)
        if old == tenant:
            return
        if old is not None:
            self._unclassify_locked(page)
        self._tenant_of[page] = tenant
        self._files_of.setdefault(tenant, set()).add(page)

    def _unclassify_locked(self, page: PageHash) -> None:
        tenant = self._tenant_of.pop(page, None)
        if tenant is None:
            return
        files = self._files_of.get(tenant)
        if files is not None:
            files.discard(page)
            if not files:
                del self._files_of[tenant]

    def gc_temp(self) -> int:
        """Remove temp files left by interrupted writes; returns how many."""
        removed = 0
        with self._lock:
            in_flight = set(self._writing)
        dirs = [self.root, *(Path(e.path) for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))]
        for directory in dirs:
            for entry in os.scandir(directory):
                if TEMP_MARK in entry.name and entry.name not in in_flight:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

    # --- bookkeeping --------------------------------------------------------------------------
    def delete(self, page: PageHash) -> int:
        with self._lock:
            size = self._sizes.pop(page, 0)
            self._used -= size
            # A file whose unlink fails below is unknown from here on: `tenant_files` reads it.
            self._unclassify_locked(page)
        # Metadata first; the unlink after it is the irreversible part.
        with contextlib.suppress(FileNotFoundError):
            self.path_of(page).unlink()
        return size

    def _page_index(self) -> Mapping[PageHash, object]:
        return self._sizes

    def check(self) -> None:
        """Invariants of the tenant index: a subset of the files held, each file under one tenant."""
        with self._lock:
            if not self._tenant_of.keys() <= self._sizes.keys():
                raise AssertionError("disk tier: a classified page file is not held")
            n = 0
            for tenant, files in self._files_of.items():
                n += len(files)
                if not files or any(self._tenant_of.get(p) != tenant for p in files):
                    raise AssertionError("disk tier: the tenant index disagrees with itself")
            if n != len(self._tenant_of):
                raise AssertionError("disk tier: the tenant index disagrees with itself")

    def size_of(self, page: PageHash) -> int | None:
        with self._lock:
            return self._sizes.get(page)

    def probe(self) -> bool:
        """Try a small durable write; the tier is available again exactly when it succeeds."""
        path = self.root / f"{_PROBE_NAME}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(path)
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
            self.available = False
            return False
        self.available = True
        return True
