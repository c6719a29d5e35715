"""The store facade: opens a data directory, wires its parts together, reports and checks them.

Exactly one process owns a data directory (an exclusive lock in `run/owner.lock`). The parts, each
with one job and its own leaf lock (see each module; no lock is ever held while another is taken):

- `versions` (`dss.dialogue.versions`): sessions, versions, branches, in the metadata database;
- `responses` (`dss.dialogue.response_store`): stored Responses API responses, each holding a version;
- `index` (`dss.index.prefix_index`): a radix trie per namespace (model fingerprint + tenant);
- `pages` (`dss.pages.manager` over `dss.pages.table`): the page table and the tiers;
- `kv` (`dss.ops.kv`): loads, saves and leases for engines, with the disk writer;
- `eraser`, `prefixes`, `dss.ops.recovery`, `dss.ops.sessions`: operations over several parts;
- `retention` (`dss.ops.retention`): session retention hints, idle demotion, warm-ups (own threads);
- `identity`, `keyring` (`dss.keys`): tenants, receipt subjects, per-tenant data keys.

Several servers may share one PostgreSQL database (`dss.fleet`), each with its own data
directory: this one's `server_id` names its page rows, its row in `servers` (heartbeat) and its
erasure acknowledgements; a follower thread applies the other servers' erasures here.

Engine processes reach the owner through `dss.rpc` (this object is its `StoreService`) and move
page bytes through the shared-memory host arena. The methods below are thin delegations, kept so
that callers have one entry point.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Sequence
from typing import IO, Any

import numpy as np
from sqlalchemy import Engine

from dss.config import StoreConfig
from dss.db.connect import is_sqlite_file, make_engine, make_session_factory, upgrade_to_head
from dss.dialogue.response_store import ResponseStore
from dss.dialogue.versions import VersionStore
from dss.errors import DataDirInUse, StoreClosed
from dss.files import try_lock_exclusive
from dss.fleet.erasures import ErasureFollower
from dss.fleet.members import Membership, resolve_server_id
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity, load_master_key
from dss.keys.keyring import Keyring
from dss.keys.upgrade import upgrade_derivation
from dss.namespace import ModelFingerprint
from dss.ops import recovery
from dss.ops.erasure import Eraser, ErasureReceipt, OnTenantErased, Verification
from dss.ops.kv import KVCache, MatchInfo
from dss.ops.prefixes import PrefixInfo, PublicPrefixes
from dss.ops.retention import SessionRetention
from dss.ops.sessions import delete_session
from dss.pages.codec import make_codec
from dss.pages.encoder import PageCodecProcess
from dss.pages.eviction import make_policy
from dss.pages.manager import TieredPages
from dss.pages.rows import PageRows
from dss.pages.table import PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import RemoteTier
from dss.rpc import StoreServer, socket_path_for
from dss.types import FingerprintId, TenantId, Tier
from dss.wire import LoadPlan, PageSlot, SavePlan

__all__ = ["ErasureReceipt", "MatchInfo", "PrefixInfo", "Store", "Verification"]


class Store:
    """Open with `Store.open(config)`; close with `close()` (also a context manager)."""

    def __init__(self, config: StoreConfig, on_tenant_erased: OnTenantErased | None = None) -> None:
        self.config = config
        self._on_tenant_erased = on_tenant_erased
        self._closed = False
        self._owner_lock: IO[bytes] | None = None
        self._rpc_server: StoreServer | None = None
        self._db_relaxed: Engine | None = None
        self.recovery_report: recovery.RecoveryReport | None = None
        self.server_id = ""
        self.membership: Membership | None = None  # None: one server (SQLite)
        self.follower: ErasureFollower | None = None

    # ================================================================== lifecycle
    @classmethod
    def open(cls, config: StoreConfig, on_tenant_erased: OnTenantErased | None = None) -> Store:
        """`on_tenant_erased(tenant)`: called (on a store thread) when another server of the fleet
        erased a tenant, before this server drops its copies: stop its running generations."""
        store = cls(config, on_tenant_erased)
        try:
            store._open()
        except BaseException:
            store._stop_fleet()
            store._release_owner_lock()
            raise
        return store

    def _open(self) -> None:
        cfg = self.config
        # Private to the owner: the database holds every message, the pages every user's KV.
        cfg.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cfg.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_owner_lock()
        self.server_id = resolve_server_id(cfg.server_id, cfg.data_dir)

        url = cfg.resolved_db_url
        upgrade_to_head(url)
        self.db = make_engine(url)
        self.sf = make_session_factory(self.db)
        if self.db.dialect.name == "postgresql":
            # Before the keyring reads the retired tenants (see `Membership.register`).
            fleet = cfg.fleet
            self.membership = Membership(self.sf, self.server_id, fleet.heartbeat_s, fleet.alive_s)
            self.membership.register()
        # Page rows commit without an fsync (see `PageRows`): the disk writer records a row per
        # page, and through an fsync each would hold SQLite's write lock that rollbacks wait for.
        self._db_relaxed = make_engine(url, durable_commits=False) if is_sqlite_file(url) else None
        relaxed_sf = make_session_factory(self._db_relaxed) if self._db_relaxed is not None else self.sf
        self.keys = load_master_key(self.sf, cfg.resolved_key_file, cfg.create_master_key)
        self.identity = Identity.load(self.sf, self.keys)
        # A store made under the first (ambiguous) derivation: before anything reads a tenant.
        upgrade_derivation(self.sf, self.identity)
        # Every write of a user's rows is fenced by the user's erasure epoch (`Identity.fence_in`).
        self.versions = VersionStore(
            self.sf, self.config.quotas, self.config.json_limits, fence=self.identity
        )
        self.responses = ResponseStore(self.sf, self.versions, self.config.json_limits)
        self.keyring = Keyring(self.keys, self.sf)
        self.fingerprints = FingerprintRegistry(self.sf)

        # The tier makes its own unguessable directory (exclusively, 0700) under `shm_dir`; the
        # record in our private run directory lets it remove the one a crashed owner left.
        self.host = HostTier(
            cfg.host_capacity_bytes, directory=cfg.shm_dir, record=cfg.run_dir / "host-arena-dir"
        )
        self.disk: DiskTier | None = DiskTier(
            cfg.disk_dir, cfg.disk_capacity_bytes, make_codec(cfg.codec), fsync=cfg.fsync
        )
        # The fleet's shared tier; Redis not answering now only makes it unavailable for a while.
        self.remote = RemoteTier(cfg.remote, make_codec(cfg.codec)) if cfg.remote.url else None
        self.index = PrefixIndex()
        page_rows = PageRows(self.sf, cfg.codec, self.server_id, add_factory=relaxed_sf)
        # Rows from before servers had ids whose files are here: a store upgraded from one server.
        page_rows.adopt_unowned(self.disk.contains if self.disk is not None else lambda _h: False)
        self.pages = TieredPages(
            PageTable(),
            self.host,
            self.disk,
            make_policy(cfg.eviction_policy),
            page_rows,
            self.keyring.data_key,
            PageCodecProcess(cfg.codec) if cfg.codec_process else None,
            self.remote,
        )
        self.recovery_report = recovery.rebuild(
            self.sf, self.disk, self.pages, self.index, self.fingerprints, self.keyring.data_key
        )
        self.kv = KVCache(cfg, self.fingerprints, self.index, self.pages, self.keyring.is_retired)
        self.prefixes = PublicPrefixes(self.sf, self.fingerprints, self.kv, self.config.json_limits)
        self.eraser = Eraser(
            self.sf,
            self.db,
            self.versions,
            self.identity,
            self.keyring,
            self.index,
            self.pages,
            self.kv,
            server_id=self.server_id,
            membership=self.membership,
            ack_timeout_s=cfg.fleet.ack_timeout_s,
            on_tenant_erased=self._on_tenant_erased,
        )
        self.retention = SessionRetention(
            cfg.retention, self.versions, self.identity.tenant_for, self.fingerprints, self.kv, self.pages
        )
        self.check()
        self.retention.start()
        if self.membership is not None:
            self.membership.start()
            self.follower = ErasureFollower(
                self.sf,
                url,
                self.server_id,
                self.eraser.apply_fleet_erasure,
                poll_s=cfg.fleet.poll_s,
                reconnect_max_s=cfg.fleet.reconnect_max_s,
            )
            self.follower.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_fleet()
        if self._rpc_server is not None:
            self._rpc_server.close()
        self.retention.close()
        self.kv.close()
        if self.pages.encoder is not None:
            self.pages.encoder.close()
        self.host.close()
        if self.remote is not None:
            self.remote.close()
        self.db.dispose()
        if self._db_relaxed is not None:
            self._db_relaxed.dispose()
        self._release_owner_lock()

    def _stop_fleet(self) -> None:
        if self.follower is not None:
            self.follower.close()
        if self.membership is not None:
            self.membership.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    @staticmethod
    def ensure_data_dir_free(config: StoreConfig) -> None:
        """`DataDirInUse` when another process owns `config`'s data directory: the owner lock,
        tried and let go at once (a server asks before it listens; `open` still decides)."""
        try:
            fd = os.open(config.owner_lock_path, os.O_RDONLY)
        except OSError:
            return  # no lock file yet: nobody ever owned it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _data_dir_in_use(config) from None
        finally:
            os.close(fd)  # closing the descriptor drops the lock, if this process took it

    def _take_owner_lock(self) -> None:
        f = try_lock_exclusive(self.config.owner_lock_path)  # held for the store's lifetime
        if f is None:
            raise _data_dir_in_use(self.config)
        self._owner_lock = f

    def _release_owner_lock(self) -> None:
        if self._owner_lock is not None:
            fcntl.flock(self._owner_lock, fcntl.LOCK_UN)
            self._owner_lock.close()
            self._owner_lock = None

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every committed page reached the disk tier (tests, clean shutdown)."""
        return self.kv.writer.flush(timeout_s) if self.kv.writer is not None else True

    # ================================================================== identity and models
    def tenant_for(self, user: str) -> TenantId:
        return self.identity.tenant_for(user)

    def epoch_of(self, user: str) -> int:
        """The user's erasure epoch now: what a request is admitted under. Its writes pass it on
        (`epoch=`) and are refused with `UserErased` once the user was erased since."""
        return self.identity.epoch_of(user)

    def tenant_at(self, user: str, epoch: int) -> TenantId:
        """The user's tenant in `epoch` (a request's, from `epoch_of` when it was admitted)."""
        return self.identity.tenant_at(user, epoch)

    def subject_hash(self, user: str) -> str:
        return self.identity.subject_hash(user)

    def receipt_subjects(self, user: str) -> set[str]:
        """What the user's erasure receipts may name: every tenant the user had (and, for receipts
        written before tenants had epochs, the subject hash)."""
        subjects = {*self.identity.tenants_of(user), self.identity.subject_hash(user)}
        if self.identity.legacy:
            subjects.add(self.identity.legacy_subject_hash(user))
        return subjects

    def register_fingerprint(self, fp: ModelFingerprint) -> FingerprintId:
        return self.fingerprints.register(fp)

    def fingerprint(self, fid: FingerprintId) -> ModelFingerprint:
        return self.fingerprints.get(fid)

    # ================================================================== KV (engines; `StoreService`)
    def match(self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray) -> MatchInfo:
        self._ensure_open()
        return self.kv.match(fid, tenant, tokens)

    def residency(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        return self.kv.residency(fid, tenant, tokens)

    def stored_bytes(
        self, tenant: TenantId, sequences: Iterable[tuple[FingerprintId, Sequence[int] | np.ndarray]]
    ) -> int:
        return self.kv.stored_bytes(tenant, sequences)

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        self._ensure_open()
        return self.kv.begin_load(fid, tenant, tokens, start_token, max_tokens)

    def wait_loaded(
        self, load_id: str, timeout_s: float = 30.0, *, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        return self.kv.wait_loaded(load_id, timeout_s, release=release, shard=shard)

    def release(self, load_id: str, shard: int | None = None) -> None:
        self.kv.release(load_id, shard)

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        with_tail: bool = False,
    ) -> SavePlan:
        self._ensure_open()
        return self.kv.plan_save(fid, tenant, tokens, n_pages, with_tail)

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int:
        return self.kv.commit_save(save_id, written, shard)

    def abort_save(self, save_id: str, shard: int | None = None) -> None:
        self.kv.abort_save(save_id, shard)

    def put_sequence(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[bytes | memoryview],
    ) -> int:
        self._ensure_open()
        return self.kv.put_sequence(fid, tenant, tokens, pages)

    def load_sequence(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> tuple[int, list[bytes]]:
        self._ensure_open()
        return self.kv.load_sequence(fid, tenant, tokens)

    # ================================================================== sessions, prefixes, erasure
    def delete_session(self, user: str, sid: str) -> int:
        """Delete a session and the cached pages only it used; returns the pages dropped."""
        dropped = delete_session(
            self.versions, self.identity, self.fingerprints, self.index, self.pages, user, sid
        )
        self.retention.forget_session(user, sid)
        return dropped

    def holds_user(self, user: str) -> bool:
        """Whether anything of `user` is stored: a session, a stored response, or a data key of
        its tenant (KV it wrote). API keys are the API's (`ApiKeys.holds_user`)."""
        return self.versions.holds_user(user) or self.keyring.holds_key(self.tenant_for(user))

    def erase_user(self, user: str) -> ErasureReceipt:
        self._ensure_open()
        receipt = self.eraser.erase_user(user)
        self.retention.forget_user(user)
        return receipt

    def verify_erasure(self, receipt_id: str) -> Verification:
        return self.eraser.verify(receipt_id)

    def get_receipt(self, receipt_id: str) -> ErasureReceipt:
        return self.eraser.get_receipt(receipt_id)

    def list_receipts(self, limit: int, after: str | None = None) -> tuple[list[ErasureReceipt], bool]:
        """Erasure receipts newest first; and whether more follow."""
        return self.eraser.list_receipts(limit, after)

    def cache_salt(self, user: str, epoch: int | None = None) -> str:
        """The engine prefix-cache salt of `user` (in `epoch`; default: the current one): the
        tenant, which moves with each erasure of the user (vLLM's own cache keeps an erased
        user's blocks until they age out; a re-created user must not hit them)."""
        return str(self.tenant_for(user) if epoch is None else self.tenant_at(user, epoch))

    # ================================================================== introspection
    def check(self) -> None:
        """Invariants of the index, the page table and the tiers, at rest (tests, post-mortems):
        the disk writer is drained first; no load or save may be running."""
        self.flush()
        self.index.check()
        missing = self.pages.table.missing(list(self.index.iter_pages()))
        if missing:
            raise AssertionError(f"the index references {len(missing)} page(s) that are in no tier")
        self.pages.check(reserved_elsewhere=self.kv.pending_slots())

    def stats(self) -> dict[str, Any]:
        used = self.pages.used_bytes()
        counts = self.pages.page_counts()
        c = self.pages.counters
        remote = self.remote.stats() if self.remote is not None else None
        if remote is not None:  # the fleet's tier as Redis reports it (this server's table has hints)
            used[Tier.REMOTE] = remote.used_bytes
            counts[Tier.REMOTE] = remote.pages
        return {
            "pages": {t.value: counts[t] for t in Tier},
            "bytes": {t.value: used[t] for t in Tier},
            "capacity_bytes": {
                Tier.HOST.value: self.host.capacity_bytes,
                Tier.DISK.value: self.disk.capacity_bytes if self.disk else 0,
                Tier.REMOTE.value: self.remote.capacity_bytes if self.remote else 0,
            },
            "hits_pages": {t.value: c.hits_pages[t] for t in Tier},
            "promotions": {t.value: c.promotions[t] for t in Tier},
            "evictions": {t.value: c.evictions[t] for t in Tier},
            "corrupt_pages": c.corrupt_pages + (self.disk.corrupt_pages if self.disk else 0),
            "disk_write_errors": c.disk_write_errors,
            "disk_full_skips": c.disk_full_skips,
            "disk_available": self.pages.disk_available,
            # None: no remote tier configured
            "remote_available": remote.available if remote is not None else None,
            "remote_error": self.remote.last_error if self.remote is not None else "",
            "remote_writes": c.remote_writes,
            "remote_write_errors": c.remote_write_errors,
            "remote_misses": c.remote_misses,
            "remote_read_bytes": c.remote_read_bytes,
            "remote_evictions": self.remote.evictions if self.remote is not None else 0,
            "disk_backlog": self.kv.writer.backlog if self.kv.writer is not None else 0,
            "indexed_tokens": self.index.indexed_tokens(),
            "demoted_pages": c.demoted_pages,
            "retention": self.retention.stats(),
            **self.kv.stats(),
        }

    # ================================================================== RPC
    def serve_rpc(self) -> tuple[str, bytes]:
        """Start (once) the local RPC server engine processes use; returns (address, authkey).
        Both are stable for the data directory, so an engine reaches a restarted owner."""
        if self._rpc_server is None:
            address = socket_path_for(self.config.run_dir)
            self._rpc_server = StoreServer(self, address, self.identity.rpc_authkey())
        return self._rpc_server.address, self._rpc_server.authkey


def _data_dir_in_use(config: StoreConfig) -> DataDirInUse:
    return DataDirInUse(
        f"another process owns the data directory {config.data_dir}: stop that server first, or give "
        "this one another --data-dir"
    )
