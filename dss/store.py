"""The store facade: one object that owns the dialogue state and the KV pages of a data directory.

Exactly one process owns a data directory (an exclusive lock in `run/owner.lock`). It holds the
metadata database, the per-namespace tries, the page table with its tiers, and the keys. Engine
processes reach it through `dss.rpc` and move page bytes through the shared-memory host arena.

Lookups go through the trie of the caller's namespace (model fingerprint + tenant). Public
prefixes registered by an admin live in the fingerprint's public namespace; a user's pages after a
public prefix chain from the public pages but stay private.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
from sqlalchemy import delete, select

from dss import erasure, recovery
from dss.codec import make_codec
from dss.config import StoreConfig
from dss.crypto import KeyManager
from dss.db.engine import make_engine, make_session_factory, upgrade_to_head
from dss.db.models import PageRow, PublicPrefixRow, StoreMeta
from dss.errors import (
    CapacityError,
    FingerprintMismatch,
    InvalidInput,
    LimitExceeded,
    PrefixNotFound,
    StorageError,
    StoreClosed,
    WrongMasterKey,
)
from dss.eviction import make_policy
from dss.hashing import ROOT_PARENT, as_tokens, chain_hashes
from dss.keyring import Keyring
from dss.namespace import ModelFingerprint, make_namespace, public_namespace, tenant_for_user
from dss.pages import PageMeta
from dss.pagestore import PageStore
from dss.plans import LoadPlan, PageSlot, SavePlan
from dss.tiers.device import DeviceTier
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier, SlotRef
from dss.trie import RadixTrie
from dss.types import (
    PUBLIC_TENANT,
    FingerprintId,
    Namespace,
    NamespaceId,
    PageHash,
    TenantId,
    Tier,
)
from dss.versions import VersionStore

log = logging.getLogger("dss.store")

_VERIFIER_KEY = "master_key_verifier"
_SECRET_KEY = "server_secret_wrapped"
_FP_PREFIX = "fingerprint:"


@dataclass(frozen=True, slots=True)
class MatchInfo:
    n_tokens: int
    pages: tuple[PageHash, ...]
    public_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    id: str
    fingerprint: FingerprintId
    n_tokens: int
    pinned: bool
    text: str | None
    created_at: float
    cached_tokens: int


@dataclass
class _Lease:
    pages: list[PageHash]  # every page pinned by the lease (from page 0)
    plan_pages: list[PageSlot]
    futures: dict[int, Future[SlotRef | None]] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)


@dataclass
class _PendingSave:
    fingerprint: FingerprintId
    namespace: Namespace
    tokens: np.ndarray
    hashes: list[PageHash]
    namespaces: list[Namespace]
    slots: dict[int, SlotRef]
    created: float = field(default_factory=time.monotonic)


class Store:
    """Open with `Store.open(config)`; close with `close()` (also a context manager)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._closed = False
        self._lock = threading.RLock()
        self._owner_lock: IO[bytes] | None = None
        self.fingerprints: dict[FingerprintId, ModelFingerprint] = {}
        self.tries: dict[NamespaceId, RadixTrie] = {}
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self._leases: dict[str, _Lease] = {}
        self._saves: dict[str, _PendingSave] = {}
        self._rpc_server: object | None = None
        self.recovery_report: recovery.RecoveryReport | None = None

    # ================================================================== lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> Store:
        store = cls(config)
        try:
            store._open()
        except BaseException:
            store._release_owner_lock()
            raise
        return store

    def _open(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self._take_owner_lock()

        url = cfg.resolved_db_url
        upgrade_to_head(url)
        self.db = make_engine(url)
        self.sf = make_session_factory(self.db)
        self.versions = VersionStore(self.sf)

        self.keys = self._load_master_key()
        self._server_secret = self._load_server_secret()
        self.keyring = Keyring(self.keys, self.sf)

        shm_dir = cfg.shm_dir or Path("/dev/shm") / f"dss-{_dir_tag(cfg.data_dir)}"
        if shm_dir.exists():  # a previous owner died without cleaning up; we hold the lock now
            shutil.rmtree(shm_dir, ignore_errors=True)
        self.host = HostTier(cfg.host_capacity_bytes, directory=shm_dir)
        self.disk: DiskTier | None = DiskTier(
            cfg.disk_dir, cfg.disk_capacity_bytes, make_codec(cfg.codec), fsync=cfg.fsync
        )
        self.device = (
            DeviceTier(cfg.device_capacity_bytes, device=cfg.device)
            if (cfg.device_capacity_bytes > 0)
            else None
        )
        self.pages = PageStore(
            host=self.host,
            disk=self.disk,
            device=self.device,
            policy=make_policy(cfg.eviction_policy),
            data_key=self.keyring.data_key,
            on_disk_written=self._record_disk_page,
            on_disk_deleted=self._forget_disk_pages,
            on_dropped=self._unlink_from_tries,
            write_through=cfg.write_through,
        )
        self._loader = ThreadPoolExecutor(max_workers=cfg.loader_threads, thread_name_prefix="dss-loader")
        self._load_fingerprints()
        self.recovery_report = recovery.rebuild(self)
        self.check()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._rpc_server is not None:
            self._rpc_server.close()  # type: ignore[attr-defined]
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.pages.close()
        self.host.close()
        self.db.dispose()
        self._release_owner_lock()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _take_owner_lock(self) -> None:
        path = self.config.run_dir / "owner.lock"
        f = open(path, "a+b")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StorageError(
                f"another process owns the data directory {self.config.data_dir} ({path} is locked)"
            ) from None
        self._owner_lock = f

    def _release_owner_lock(self) -> None:
        if self._owner_lock is not None:
            fcntl.flock(self._owner_lock, fcntl.LOCK_UN)
            self._owner_lock.close()
            self._owner_lock = None

    def _meta_get(self, key: str) -> str | None:
        with self.sf() as s:
            row = s.get(StoreMeta, key)
            return row.value if row else None

    def _meta_set(self, key: str, value: str) -> None:
        with self.sf() as s, s.begin():
            row = s.get(StoreMeta, key)
            if row is None:
                s.add(StoreMeta(key=key, value=value))
            else:
                row.value = value

    def _load_master_key(self) -> KeyManager:
        verifier = self._meta_get(_VERIFIER_KEY)
        # A store that already holds data must never silently get a fresh master key.
        keys = KeyManager.load(
            self.config.resolved_key_file,
            create_if_missing=self.config.create_master_key and verifier is None,
        )
        if getattr(keys, "generated", False):
            log.warning(
                "generated a new master key at %s: back it up; without it the disk tier is unreadable",
                self.config.resolved_key_file,
            )
        if verifier is None:
            self._meta_set(_VERIFIER_KEY, keys.make_verifier().hex())
        else:
            try:
                keys.check_verifier(bytes.fromhex(verifier))
            except WrongMasterKey:
                raise
            except Exception as exc:
                raise WrongMasterKey(f"master key from {keys.source} does not open this store") from exc
        return keys

    def _load_server_secret(self) -> bytes:
        wrapped = self._meta_get(_SECRET_KEY)
        if wrapped is None:
            secret = secrets.token_bytes(32)
            self._meta_set(_SECRET_KEY, self.keys.wrap(secret, "server-secret").hex())
            return secret
        return self.keys.unwrap(bytes.fromhex(wrapped), "server-secret")

    # ================================================================== identity
    def tenant_for(self, user: str) -> TenantId:
        return tenant_for_user(self._server_secret, user)

    def subject_hash(self, user: str) -> str:
        """The salted hash of a user id written into erasure receipts (never the id itself)."""
        return hashlib.blake2b(
            b"dss-subject\x00" + user.encode(), key=self._server_secret[:32], digest_size=20
        ).hexdigest()

    def register_fingerprint(self, fp: ModelFingerprint) -> FingerprintId:
        fid = fp.id
        with self._lock:
            if fid not in self.fingerprints:
                self.fingerprints[fid] = fp
                self._meta_set(_FP_PREFIX + fid, fp.to_json())
        return fid

    def _load_fingerprints(self) -> None:
        with self.sf() as s:
            rows = s.execute(select(StoreMeta).where(StoreMeta.key.like(_FP_PREFIX + "%"))).scalars()
            for row in rows:
                fp = ModelFingerprint.from_json(row.value)
                self.fingerprints[fp.id] = fp

    def fingerprint(self, fid: FingerprintId) -> ModelFingerprint:
        fp = self.fingerprints.get(fid)
        if fp is None:
            raise FingerprintMismatch(f"unknown model fingerprint {fid}")
        return fp

    def namespace(self, fid: FingerprintId, tenant: TenantId) -> Namespace:
        ns = make_namespace(fid, tenant)
        with self._lock:
            self.namespaces.setdefault(ns.id, ns)
        return ns

    def _trie(self, ns: Namespace, create: bool) -> RadixTrie | None:
        with self._lock:
            trie = self.tries.get(ns.id)
            if trie is None and create:
                trie = RadixTrie(self.fingerprint(ns.fingerprint).block_size)
                self.tries[ns.id] = trie
                self.namespaces[ns.id] = ns
            return trie

    # ================================================================== matching
    def match(self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray) -> MatchInfo:
        """Longest stored prefix (whole pages) for `tokens` in the tenant's namespace, public
        prefixes included. Pages that left every tier end the match."""
        self._ensure_open()
        arr = as_tokens(tokens)
        if len(arr) > self.config.max_tokens_per_sequence:
            raise LimitExceeded(
                f"{len(arr)} tokens exceed the limit of {self.config.max_tokens_per_sequence}"
            )
        self.fingerprint(fid)
        with self._lock:
            pub_trie = self._trie(public_namespace(fid), create=False)
            pub = pub_trie.match(arr) if pub_trie is not None else None
            own_trie = (
                self._trie(self.namespace(fid, tenant), create=False) if tenant != PUBLIC_TENANT else None
            )
            own = own_trie.match(arr) if own_trie is not None else None
            best = own if own is not None and (pub is None or own.n_tokens >= pub.n_tokens) else pub
            if best is None:
                return MatchInfo(0, (), 0)
            pages = list(best.pages)
            n_ok = 0
            for h in pages:
                if not self.pages.contains(h):
                    break
                n_ok += 1
            bs = self.fingerprint(fid).block_size
            pub_tokens = min(pub.n_tokens if pub is not None else 0, n_ok * bs)
            return MatchInfo(n_ok * bs, tuple(pages[:n_ok]), pub_tokens)

    def residency(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        """Tokens of `tokens` whose KV is resident in each tier now (fastest copy counts)."""
        m = self.match(fid, tenant, tokens)
        bs = self.fingerprint(fid).block_size
        out = {t.value: 0 for t in Tier}
        for h in m.pages:
            t = self.pages.fastest_tier(h)
            if t is not None:
                out[t.value] += bs
        return out

    # ================================================================== loading
    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        """Match and pin the pages after `start_token` (a multiple of the block size). Pages only
        on disk are promoted into the host arena by loader threads (the plan is then async)."""
        m = self.match(fid, tenant, tokens)
        bs = self.fingerprint(fid).block_size
        if start_token % bs:
            raise InvalidInput(f"start_token {start_token} is not a multiple of the block size {bs}")
        first = start_token // bs
        last = len(m.pages)
        if max_tokens is not None:
            last = min(last, max_tokens // bs)
        if last <= first:
            return None
        load_id = uuid.uuid4().hex
        self._expire_stale()
        with self._lock:
            pinned = list(m.pages[:last])
            self.pages.lease(pinned)
            self.pages.touch(pinned[first:])
            lease = _Lease(pages=pinned, plan_pages=[])
            tier_tokens = {t.value: 0 for t in Tier}
            plan_pages: list[PageSlot] = []
            for i in range(first, last):
                h = m.pages[i]
                ref = self.pages.host_slot(h)
                if ref is None:
                    lease.futures[i] = self._loader.submit(self.pages.promote_to_host, h)
                    tier_tokens[Tier.DISK.value] += bs
                else:
                    tier_tokens[Tier.HOST.value] += bs
                plan_pages.append(PageSlot(i, h, ref))
            lease.plan_pages = plan_pages
            self._leases[load_id] = lease
        return LoadPlan(
            load_id, (last - first) * bs, start_token, tuple(plan_pages), bool(lease.futures), tier_tokens
        )

    def wait_loaded(self, load_id: str, timeout_s: float = 30.0) -> tuple[PageSlot | None, ...]:
        """Every page of the plan with its host slot, or None where the page could not be had."""
        with self._lock:
            lease = self._leases.get(load_id)
        if lease is None:
            return ()
        deadline = time.monotonic() + timeout_s
        out: list[PageSlot | None] = []
        for ps in lease.plan_pages:
            fut = lease.futures.get(ps.page_index)
            if fut is None:
                out.append(ps if self.pages.contains(ps.hash) else None)
                continue
            try:
                ref = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                ref = None
            out.append(PageSlot(ps.page_index, ps.hash, ref) if ref is not None else None)
        return tuple(out)

    def release(self, load_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(load_id, None)
        if lease is not None:
            self.pages.unlease(lease.pages)

    def _expire_stale(self) -> None:
        """Free leases and reserved save slots whose engine never came back (it died mid-load or
        mid-save): otherwise their pages could never be evicted."""
        limit = time.monotonic() - self.config.lease_timeout_s
        with self._lock:
            stale_loads = [k for k, v in self._leases.items() if v.created < limit]
            stale_saves = [k for k, v in self._saves.items() if v.created < limit]
        for k in stale_loads:
            log.warning("releasing load %s: not released within %ss", k, self.config.lease_timeout_s)
            self.release(k)
        for k in stale_saves:
            log.warning("aborting save %s: not committed within %ss", k, self.config.lease_timeout_s)
            self.abort_save(k)

    def read_page(self, page: PageHash) -> bytes | None:
        return self.pages.read_bytes(page)

    # ================================================================== saving
    def plan_save(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, n_pages: int
    ) -> SavePlan:
        """Reserve host slots for the pages of `tokens[: n_pages * block_size]` that the store lacks."""
        self._ensure_open()
        self._expire_stale()
        fp = self.fingerprint(fid)
        bs = fp.block_size
        arr = as_tokens(tokens)
        if len(arr) > self.config.max_tokens_per_sequence:
            raise LimitExceeded(
                f"{len(arr)} tokens exceed the limit of {self.config.max_tokens_per_sequence}"
            )
        n_pages = min(n_pages, len(arr) // bs)
        arr = arr[: n_pages * bs]
        own_ns = self.namespace(fid, tenant)
        pub_ns = public_namespace(fid)
        with self._lock:
            pub_trie = self._trie(pub_ns, create=False)
            k_pub = 0
            pub_pages: tuple[PageHash, ...] = ()
            if pub_trie is not None and tenant != PUBLIC_TENANT:
                pm = pub_trie.match(arr, touch=False)
                k_pub, pub_pages = pm.n_pages, tuple(pm.pages)
            parent = pub_pages[-1] if k_pub else ROOT_PARENT
            hashes = list(pub_pages) + chain_hashes(own_ns.id, arr, bs, parent=parent, start_page=k_pub)
            namespaces = [pub_ns] * k_pub + [own_ns] * (n_pages - k_pub)
            slots: dict[int, SlotRef] = {}
            try:
                for i, h in enumerate(hashes):
                    if not self.pages.contains(h):
                        slots[i] = self.pages.reserve_host(fp.page_nbytes)
            except Exception:
                for ref in slots.values():
                    self.pages.release_host(ref)
                raise
            save_id = uuid.uuid4().hex
            self._saves[save_id] = _PendingSave(fid, own_ns, arr, hashes, namespaces, slots)
            # Pages we already hold still need linking into this namespace's trie (e.g. the user
            # reached a page through a public prefix for the first time).
            if not slots:
                self._link(self._saves.pop(save_id))
        return SavePlan(save_id, tuple(PageSlot(i, hashes[i], ref) for i, ref in sorted(slots.items())))

    def commit_save(self, save_id: str, written: Sequence[int]) -> int:
        """Publish the pages the engine copied into their slots; returns how many were new."""
        with self._lock:
            pending = self._saves.pop(save_id, None)
            if pending is None:
                return 0
            fp = self.fingerprint(pending.fingerprint)
            done = set(written)
            new = 0
            # Pages must be contiguous from 0 to be reachable: stop at the first missing one.
            upto = 0
            for i in range(len(pending.hashes)):
                if i in pending.slots and i not in done:
                    break
                upto = i + 1
            for i, ref in pending.slots.items():
                if i >= upto:
                    self.pages.release_host(ref)
                    continue
                ns = pending.namespaces[i]
                meta = PageMeta(
                    hash=pending.hashes[i],
                    namespace=ns.id,
                    tenant=ns.tenant,
                    fingerprint=pending.fingerprint,
                    parent=pending.hashes[i - 1] if i else ROOT_PARENT,
                    index=i,
                    nbytes=fp.page_nbytes,
                    tokens=pending.tokens[i * fp.block_size : (i + 1) * fp.block_size].copy(),
                )
                if self.pages.publish(meta, ref):
                    new += 1
            pending.hashes = pending.hashes[:upto]
            pending.namespaces = pending.namespaces[:upto]
            pending.tokens = pending.tokens[: upto * fp.block_size]
            self._link(pending)
            if pending.namespace.is_public:
                self._apply_pins(pending.fingerprint)
            return new

    def abort_save(self, save_id: str) -> None:
        with self._lock:
            pending = self._saves.pop(save_id, None)
            if pending is not None:
                for ref in pending.slots.values():
                    self.pages.release_host(ref)

    def _link(self, pending: _PendingSave) -> None:
        """Insert a saved sequence into its namespace's trie (and the public part into the public trie)."""
        if not pending.hashes:
            return
        fp = self.fingerprint(pending.fingerprint)
        bs = fp.block_size
        n = len(pending.hashes)
        # Only pages that exist in some tier are reachable; stop at the first gap.
        n_ok = 0
        for h in pending.hashes:
            if not self.pages.contains(h):
                break
            n_ok += 1
        if n_ok == 0:
            return
        n = n_ok
        tokens = pending.tokens[: n * bs]
        hashes = pending.hashes[:n]
        trie = self._trie(pending.namespace, create=True)
        assert trie is not None
        self._insert_replacing(trie, tokens, hashes)

    def _insert_replacing(self, trie: RadixTrie, tokens: np.ndarray, hashes: list[PageHash]) -> None:
        """Insert, first cutting a stale path that hashes the same tokens differently (a public
        prefix registered after the user cached the same tokens privately)."""
        existing = trie.match(tokens, touch=False)
        for i, h in enumerate(existing.pages):
            if h != hashes[i]:
                removed = trie.remove_from(h)
                still_used = {p for t in self.tries.values() for p in removed if p in t}
                self.pages.drop([p for p in removed if p not in still_used], notify=False)
                break
        trie.insert(tokens, hashes)

    # ================================================================== in-process convenience
    def put_sequence(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[bytes | memoryview],
    ) -> int:
        """Store whole pages for `tokens` (page i = bytes of block i). Returns new pages stored."""
        fp = self.fingerprint(fid)
        for p in pages:
            if len(p) != fp.page_nbytes:
                from dss.errors import PageShapeMismatch

                raise PageShapeMismatch(f"page of {len(p)} bytes; fingerprint {fid} needs {fp.page_nbytes}")
        plan = self.plan_save(fid, tenant, tokens, len(pages))
        for ps in plan.pages:
            assert ps.slot is not None
            self.host.arena_view(ps.slot)[:] = pages[ps.page_index]
        return self.commit_save(plan.save_id, [ps.page_index for ps in plan.pages])

    def load_sequence(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> tuple[int, list[bytes]]:
        """Tokens matched and a copy of each matched page's bytes (stops at a failed page)."""
        plan = self.begin_load(fid, tenant, tokens)
        if plan is None:
            return 0, []
        try:
            out: list[bytes] = []
            for ps in self.wait_loaded(plan.load_id):
                if ps is None or ps.slot is None:
                    break
                out.append(bytes(self.host.arena_view(ps.slot)))
            return len(out) * self.fingerprint(fid).block_size, out
        finally:
            self.release(plan.load_id)

    # ================================================================== public prefixes
    def register_public_prefix(
        self,
        fid: FingerprintId,
        tokens: Sequence[int] | np.ndarray,
        *,
        text: str | None = None,
        messages: list[dict[str, object]] | None = None,
        pin: bool = False,
    ) -> PrefixInfo:
        fp = self.fingerprint(fid)
        arr = as_tokens(tokens)
        if len(arr) < fp.block_size:
            raise InvalidInput(
                f"a public prefix must cover at least one full page ({fp.block_size} tokens); got {len(arr)}"
            )
        pid = "pfx_" + uuid.uuid4().hex[:24]
        with self.sf() as s, s.begin():
            s.add(
                PublicPrefixRow(
                    id=pid,
                    fingerprint=fid,
                    n_tokens=len(arr),
                    tokens=arr.tobytes(),
                    text=text,
                    messages=messages,
                    pinned=pin,
                )
            )
        self._apply_pins(fid)
        return self.get_public_prefix(pid)

    def _prefix_info(self, row: PublicPrefixRow) -> PrefixInfo:
        tokens = np.frombuffer(row.tokens, dtype="<i4")
        cached = (
            self.match(FingerprintId(row.fingerprint), PUBLIC_TENANT, tokens).n_tokens
            if (row.fingerprint in self.fingerprints)
            else 0
        )
        return PrefixInfo(
            row.id,
            FingerprintId(row.fingerprint),
            row.n_tokens,
            bool(row.pinned),
            row.text,
            row.created_at.timestamp(),
            cached,
        )

    def get_public_prefix(self, pid: str) -> PrefixInfo:
        with self.sf() as s:
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            return self._prefix_info(row)

    def public_prefix_tokens(self, pid: str) -> np.ndarray:
        with self.sf() as s:
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            return np.frombuffer(row.tokens, dtype="<i4").copy()

    def list_public_prefixes(self) -> list[PrefixInfo]:
        with self.sf() as s:
            rows = s.execute(
                select(PublicPrefixRow).order_by(PublicPrefixRow.created_at, PublicPrefixRow.id)
            ).scalars()
            return [self._prefix_info(r) for r in rows]

    def delete_public_prefix(self, pid: str) -> None:
        with self.sf() as s, s.begin():
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            fid = FingerprintId(row.fingerprint)
            tokens = np.frombuffer(row.tokens, dtype="<i4").copy()
            s.delete(row)
        if fid in self.fingerprints:
            m = self.match(fid, PUBLIC_TENANT, tokens)
            self.pages.set_pinned(m.pages, False)
            self._apply_pins(fid)

    def _apply_pins(self, fid: FingerprintId) -> None:
        with self.sf() as s:
            rows = s.execute(
                select(PublicPrefixRow.tokens).where(
                    PublicPrefixRow.fingerprint == fid, PublicPrefixRow.pinned.is_(True)
                )
            ).scalars()
            token_sets = [np.frombuffer(t, dtype="<i4") for t in rows]
        for tokens in token_sets:
            self.pages.set_pinned(self.match(fid, PUBLIC_TENANT, tokens).pages, True)

    # ================================================================== deleting sessions
    def drop_sequence_pages(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        drop: Sequence[Sequence[int] | np.ndarray],
        keep: Sequence[Sequence[int] | np.ndarray] = (),
    ) -> int:
        """Drop the tenant's private pages on the paths of `drop` that no path of `keep` uses.

        For a deleted session: `drop` = its versions' tokens, `keep` = the user's other versions.
        Public-prefix pages stay, and so do pages another namespace's trie still reaches.
        Returns the number of pages dropped from every tier.
        """
        self._ensure_open()
        if tenant == PUBLIC_TENANT:
            raise InvalidInput("public pages are removed through their public prefix")
        with self._lock:
            trie = self._trie(self.namespace(fid, tenant), create=False)
            if trie is None:
                return 0
            paths = [trie.match(as_tokens(t), touch=False).pages for t in drop]
            kept = {h for t in keep for h in trie.match(as_tokens(t), touch=False).pages}
            removed: list[PageHash] = []
            for path in paths:
                # The first private page of a path that no kept path shares: it and everything
                # below it in the trie belong to dropped paths only.
                for h in path:
                    if h in kept or h not in trie:
                        continue
                    entry = self.pages.entries.get(h)
                    if entry is not None and entry.meta.tenant != tenant:
                        continue
                    # A load may hold it right now; then it stays a cache entry like any other.
                    with contextlib.suppress(CapacityError):
                        removed.extend(trie.remove_from(h))
                    break
            still_used = {p for t in self.tries.values() for p in removed if p in t}
            victims = [p for p in removed if p not in still_used]
        self.pages.drop(victims, notify=False)
        return len(victims)

    # ================================================================== erasure
    def erase_user(self, user: str) -> erasure.ErasureReceipt:
        self._ensure_open()
        return erasure.erase_user(self, user)

    def verify_erasure(self, receipt_id: str) -> erasure.Verification:
        return erasure.verify(self, receipt_id)

    def get_receipt(self, receipt_id: str) -> erasure.ErasureReceipt:
        return erasure.get_receipt(self, receipt_id)

    def _drop_tenant_index(self, tenant: TenantId) -> list[PageHash]:
        """Forget the tenant's tries; returns the tenant's own pages (public pages stay)."""
        with self._lock:
            for ns_id in [k for k, ns in self.namespaces.items() if ns.tenant == tenant]:
                self.tries.pop(ns_id, None)
                self.namespaces.pop(ns_id, None)
            return self.pages.pages_of_tenant(tenant)

    # ================================================================== callbacks from the page store
    def _record_disk_page(self, meta: PageMeta, disk_bytes: int) -> None:
        with self.sf() as s, s.begin():
            if s.get(PageRow, meta.hash) is None:
                s.add(
                    PageRow(
                        hash=meta.hash,
                        namespace=meta.namespace,
                        tenant=meta.tenant,
                        fingerprint=meta.fingerprint,
                        parent=meta.parent,
                        page_index=meta.index,
                        n_tokens=meta.n_tokens,
                        tokens=meta.tokens.tobytes(),
                        nbytes=meta.nbytes,
                        disk_bytes=disk_bytes,
                        codec=self.config.codec,
                        checksum=meta.checksum or b"",
                    )
                )

    def _forget_disk_pages(self, pages: list[PageHash]) -> None:
        with self.sf() as s, s.begin():
            for chunk in _chunks(pages, 500):
                s.execute(delete(PageRow).where(PageRow.hash.in_(chunk)))

    def _unlink_from_tries(self, gone: list[PageHash]) -> None:
        """Pages that left every tier: cut them (and what hangs below them) out of every trie."""
        orphans: list[PageHash] = []
        with self._lock:
            for h in gone:
                for trie in list(self.tries.values()):
                    if h in trie:
                        orphans.extend(p for p in trie.remove_from(h) if p != h)
        orphans = [
            p for p in orphans if self.pages.contains(p) and not any(p in t for t in self.tries.values())
        ]
        if orphans:
            self.pages.drop(orphans)

    # ================================================================== introspection
    def check(self) -> None:
        """Invariants of every trie, the page table and the tiers (tests and post-mortems)."""
        with self._lock:
            for trie in self.tries.values():
                trie.check()
                for h in trie.iter_pages():
                    if not self.pages.contains(h):
                        raise AssertionError(f"trie references page {h.hex()[:16]} that is in no tier")
            self.pages.check()

    def stats(self) -> dict[str, object]:
        used = self.pages.used_bytes()
        counts = self.pages.page_counts()
        c = self.pages.counters
        return {
            "pages": {t.value: counts[t] for t in Tier},
            "bytes": {t.value: used[t] for t in Tier},
            "capacity_bytes": {
                Tier.HOST.value: self.host.capacity_bytes,
                Tier.DISK.value: self.disk.capacity_bytes if self.disk else 0,
                Tier.DEVICE.value: self.device.capacity_bytes if self.device else 0,
            },
            "hits_pages": {t.value: c.hits_pages[t] for t in Tier},
            "promotions": {t.value: c.promotions[t] for t in Tier},
            "evictions": {t.value: c.evictions[t] for t in Tier},
            "corrupt_pages": c.corrupt_pages + (self.disk.corrupt_pages if self.disk else 0),
            "disk_write_errors": c.disk_write_errors,
            "disk_available": self.pages.disk_available,
            "indexed_tokens": sum(len(t) for t in self.tries.values()),
            "leases": len(self._leases),
        }

    # ================================================================== RPC
    def serve_rpc(self) -> tuple[str, bytes]:
        """Start (once) the local RPC server engine processes use; returns (address, authkey)."""
        from dss.rpc import StoreServer

        with self._lock:
            if self._rpc_server is None:
                address = str(self.config.run_dir / f"store-{os.getpid()}.sock")
                self._rpc_server = StoreServer(self, address, secrets.token_bytes(32))
            srv = self._rpc_server
        return srv.address, srv.authkey  # type: ignore[attr-defined]


def _dir_tag(path: Path) -> str:
    return hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()


def _chunks(items: list[PageHash], n: int) -> list[list[PageHash]]:
    return [items[i : i + n] for i in range(0, len(items), n)]
