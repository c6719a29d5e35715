"""The composition root: opens a data directory, wires its parts together, reports and checks them.

Exactly one process owns a data directory (an exclusive lock in `run/owner.lock`). The parts, each
with one job and its own leaf lock (see each module and the "Locks" section of docs/architecture.md):

- `versions` (`dss.dialogue.versions`): sessions, versions, branches, in the metadata database;
- `responses` (`dss.dialogue.response_store`): stored Responses API responses, each holding a version;
- `conversations` (`dss.dialogue.conversations`): the Conversations API's view of sessions;
- `index` (`dss.index.prefix_index`): a radix trie per namespace (model fingerprint + tenant);
- `pages` (`dss.pages.placement` over `dss.pages.table`): the page table and the tiers;
- `kv` (`dss.ops.kv`): matches, loads, saves and leases for engines, with the disk writer;
- `eraser` (`dss.ops.erasure`), `prefixes` (`dss.ops.kv.public_prefixes`), `sessions`
  (`dss.ops.session_kv`), `dss.ops.recovery`: operations over several parts;
- `retention` (`dss.ops.retention`): session retention hints, idle demotion, warm-ups (own threads);
- `identity`, `keyring` (`dss.keys`): tenants, receipt subjects, per-tenant data keys.

Several servers may share one PostgreSQL database (`dss.fleet`), each with its own data
directory: this one's `server_id` names its page rows, its row in `servers` (heartbeat) and its
erasure acknowledgements; a follower thread applies the other servers' erasures here.

Callers use the parts by name (`store.kv.match(...)`, `store.identity.tenant_for(...)`,
`store.eraser.erase_user(...)`): `Store` keeps only the lifecycle (`open`, `close`, `flush`),
`check()`, `stats()` and `serve_rpc()`. Engine processes reach the owner through `dss.rpc`, which
serves `kv` through `EngineCalls` (the table of what an engine may call), and move page bytes
through the shared-memory host arena.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO, Any, Protocol

from sqlalchemy import Engine, orm

from dss.config import StoreConfig
from dss.db.connect import (
    checkout_free,
    is_sqlite_file,
    make_engine,
    make_session_factory,
    upgrade_to_head,
    write_gate_of,
)
from dss.db.write_gate import WriteGate
from dss.dialogue.conversations import Conversations
from dss.dialogue.response_store import ResponseStore
from dss.dialogue.versions import VersionStore
from dss.errors import DataDirInUse
from dss.files import try_lock_exclusive
from dss.fleet.erasures import ErasureFollower
from dss.fleet.members import Membership, resolve_server_id
from dss.fleet.page_drops import PageDrops
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.keys.crypto import KeyManager, forget_env_master_key
from dss.keys.identity import Identity, load_master_key
from dss.keys.keyring import Keyring
from dss.ops import recovery
from dss.ops.erasure.eraser import Eraser, OnTenantErased
from dss.ops.erasure.receipts import ErasureReceipt
from dss.ops.erasure.verify import Verification
from dss.ops.key_changes.derivation_upgrade import upgrade_derivation
from dss.ops.kv import KVCache, MatchInfo
from dss.ops.kv.public_prefixes import PrefixInfo, PublicPrefixes
from dss.ops.retention import SessionRetention
from dss.ops.session_kv import Sessions
from dss.pages.codec import make_codec
from dss.pages.encoder import PageCodecProcess
from dss.pages.eviction import make_policy
from dss.pages.placement import TieredPages
from dss.pages.rows import PageRows, delete_pages_in
from dss.pages.table import PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import RemoteTier
from dss.rpc import EngineCalls, StoreServer, socket_path_for
from dss.types import FingerprintId, Tier, UserId

__all__ = ["ErasureReceipt", "MatchInfo", "PrefixInfo", "Store", "Verification"]


class ApiTables(Protocol):
    """What the store must do to the API's own tables (`api_keys`, `admin_audit`: their owner is
    `api`, `dss.db.models.TABLE_OWNERS`), each in the store's transaction: the API passes it to
    `Store.open`, since `dss` never imports `api`."""

    def users_in(self, db: orm.Session) -> set[UserId]:
        """The users the API's keys act as (the tenant-derivation upgrade moves their epochs)."""
        ...

    def pseudonymise_audit_in(self, db: orm.Session, user: UserId, pseudonym: str) -> int:
        """An erasure: the audit entries naming `user` name `pseudonym` instead; how many."""
        ...


class Store:
    """Open with `Store.open(config)`; close with `close()` (also a context manager).

    The parts, by name (set by `open`; callers use them directly, each through its own interface):
    """

    db: Engine
    sf: orm.sessionmaker[orm.Session]
    keys: KeyManager
    versions: VersionStore
    responses: ResponseStore
    conversations: Conversations
    identity: Identity  # tenants, erasure epochs, receipt subjects, engine cache salts
    keyring: Keyring
    fingerprints: FingerprintRegistry
    index: PrefixIndex
    pages: TieredPages
    host: HostTier
    disk: DiskTier | None
    remote: RemoteTier | None
    kv: KVCache  # match, loads, saves, leases, residency, stored KV
    prefixes: PublicPrefixes
    sessions: Sessions  # a session's stored KV and residency; session deletion
    eraser: Eraser  # erasure, receipts, verification, `holds_user`
    retention: SessionRetention

    def __init__(
        self,
        config: StoreConfig,
        on_tenant_erased: OnTenantErased | None = None,
        api_tables: ApiTables | None = None,
    ) -> None:
        self.config = config
        self._on_tenant_erased = on_tenant_erased
        self._api_tables = api_tables
        self._closed = False
        self._owner_lock: IO[bytes] | None = None
        self._rpc_server: StoreServer | None = None
        self._db_relaxed: Engine | None = None
        self.recovery_report: recovery.RecoveryReport | None = None
        self.server_id = ""
        self.membership: Membership | None = None  # None: one server (SQLite)
        self.follower: ErasureFollower | None = None
        self.page_drops: PageDrops | None = None  # a fleet: sessions deleted reach every server

    # ================================================================== lifecycle
    @classmethod
    def open(
        cls,
        config: StoreConfig,
        on_tenant_erased: OnTenantErased | None = None,
        api_tables: ApiTables | None = None,
    ) -> Store:
        """`on_tenant_erased(tenant)`: called (on a store thread) when another server of the fleet
        erased a tenant, before this server drops its copies: stop its running generations.
        `api_tables`: the API's own tables (None: a store without the API, which has none)."""
        store = cls(config, on_tenant_erased, api_tables)
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
            self.page_drops = PageDrops(self.sf, self.server_id, fleet.alive_s, delete_pages_in)
        # Page rows commit without an fsync (see `PageRows`): the disk writer records a row per
        # page, and through an fsync each would hold SQLite's write lock that rollbacks wait for.
        self._db_relaxed = make_engine(url, durable_commits=False) if is_sqlite_file(url) else None
        self._write_gate = write_gate_of(url)
        relaxed_sf = make_session_factory(self._db_relaxed) if self._db_relaxed is not None else self.sf
        self.keys = load_master_key(self.sf, cfg.resolved_key_file, cfg.create_master_key)
        if cfg.forget_env_master_key:
            forget_env_master_key()  # before the page codec's process (below) and any engine start
        self.identity = Identity.load(self.sf, self.keys, cfg.identity_cache_entries)
        # A store made under the first (ambiguous) derivation: before anything reads a tenant.
        api = self._api_tables
        upgrade_derivation(self.sf, self.identity, api.users_in if api is not None else None)
        # Every write of a user's rows is fenced by the user's erasure epoch (`Identity.fence_in`).
        self.versions = VersionStore(
            self.sf, self.config.quotas, self.config.json_limits, fence=self.identity
        )
        self.responses = ResponseStore(self.sf, self.versions, self.config.json_limits)
        self.conversations = Conversations(self.versions)
        self.keyring = Keyring(self.keys, self.sf, self.config.data_key_cache_entries)
        disk_codec, remote_codec = make_codec(cfg.codec), make_codec(cfg.remote.codec)
        lossy = next((c.name for c in (disk_codec, remote_codec) if not c.lossless), None)
        self.fingerprints = FingerprintRegistry(self.sf, bf16_only_codec=lossy)

        # The tier makes its own unguessable directory (exclusively, 0700) under `shm_dir`; the
        # record in our private run directory lets it remove the one a crashed owner left.
        self.host = HostTier(
            cfg.host_capacity_bytes, directory=cfg.shm_dir, record=cfg.run_dir / "host-arena-dir"
        )
        self.disk: DiskTier | None = DiskTier(
            cfg.disk_dir, cfg.disk_capacity_bytes, disk_codec, fsync=cfg.fsync
        )
        # The fleet's shared tier; Redis not answering now only makes it unavailable for a while.
        self.remote = RemoteTier(cfg.remote, remote_codec) if cfg.remote.url else None
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
            self.disk, self.pages, self.index, self.fingerprints, self.keyring
        )
        self.kv = KVCache(cfg, self.fingerprints, self.index, self.pages, self.keyring.is_retired)
        self.prefixes = PublicPrefixes(self.sf, self.fingerprints, self.kv, self.config.json_limits)
        self.retention = SessionRetention(
            cfg.retention, self.versions, self.identity.tenant_for, self.fingerprints, self.kv, self.pages
        )
        self.sessions = Sessions(
            self.versions,
            self.identity,
            self.fingerprints,
            self.index,
            self.pages,
            self.kv,
            on_deleted=self.retention.forget_session,
            public_prefixes=self.prefixes.registered,
            pages_deleted=self.page_drops.record if self.page_drops is not None else None,
        )
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
            on_user_erased=self.retention.forget_user,
            pseudonymise_audit_in=api.pseudonymise_audit_in if api is not None else None,
        )
        self.check()
        self.eraser.scrub_at_open()  # before the retention sweeper reads (the writer has no work yet)
        self.retention.sweeper.start()
        if self.membership is not None:
            self.membership.start()
            self.follower = ErasureFollower(
                self.sf,
                url,
                self.server_id,
                self.eraser.apply_fleet_erasure,
                poll_s=cfg.fleet.poll_s,
                reconnect_max_s=cfg.fleet.reconnect_max_s,
                also_catch_up=self._catch_up_page_drops,
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

    def _catch_up_page_drops(self) -> int:
        """On the follower thread: the other servers' deleted sessions' pages go here too."""
        assert self.page_drops is not None and self.follower is not None
        return self.page_drops.catch_up(self.sessions.apply_fleet_drop, self.follower.stopping)

    def _stop_fleet(self) -> None:
        if self.follower is not None:
            self.follower.close()
        if self.membership is not None:
            self.membership.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    @property
    def write_gate(self) -> WriteGate | None:
        """The gate this process's writers of the SQLite file pass (`dss.db.write_gate`); None
        on PostgreSQL, where a write may wait for another transaction's row lock that no gate
        of this process knows."""
        return self._write_gate

    def db_checkout_free(self) -> bool:
        """Whether a write's checkout of a pooled connection now waits for no other thread
        (`dss.db.connect.checkout_free`)."""
        return checkout_free(self.db)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every committed page reached the disk tier (tests, clean shutdown)."""
        return self.kv.writer.flush(timeout_s) if self.kv.writer is not None else True

    # ================================================================== introspection
    def check(self) -> None:
        """Invariants of the index, the page table and the tiers, at rest (tests, post-mortems):
        the disk writer is drained first; no load or save may be running."""
        self.flush()
        self.index.check()
        missing = self.pages.table.missing(list(self.index.iter_pages()))
        if missing:
            raise AssertionError(f"the index references {len(missing)} page(s) that are in no tier")
        self.pages.check(reserved_elsewhere=self.kv.saves.pending_slots())

    def stats(self) -> dict[str, Any]:
        used = self.pages.used_bytes()
        counts = self.pages.page_counts()
        c = self.pages.counters
        remote = self.remote.stats() if self.remote is not None else None
        rt = self.remote.read_times() if self.remote is not None else None
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
            # Where a remote read's time goes: Redis round trips, decoding (checksums, AES-GCM,
            # zstd) on the reader threads, and copying into host slots (`RemoteTier.read_many`).
            "remote_read_seconds": {
                "network": rt.network_s if rt is not None else 0.0,
                "decode": rt.decode_s if rt is not None else 0.0,
                "promote": c.remote_promote_s,
            },
            # wall-clock seconds of the reads (`ReadTimes.wall_s`): bytes over these is the rate
            "remote_read_wall_seconds": rt.wall_s if rt is not None else 0.0,
            "remote_read_pages": rt.pages if rt is not None else 0,
            "remote_read_batches": rt.batches if rt is not None else 0,
            "prefetch_started": c.prefetch_started,
            "prefetch_skipped": c.prefetch_skipped,
            "prefetch_pages": c.prefetch_pages,
            "disk_backlog": self.kv.writer.backlog if self.kv.writer is not None else 0,
            "indexed_tokens": self.index.indexed_tokens(),
            "demoted_pages": c.demoted_pages,
            "retention": self.retention.stats(),
            # page events for KV-aware routers: fingerprints read, events queued, events dropped
            "kv_events": self.pages.table.event_stats(),
            **self.kv.stats(),
        }

    # ================================================================== RPC
    def engine_calls(self) -> EngineCalls:
        """What engine processes may call (the contract, `dss.rpc.EngineStore`), answered by the
        part that owns each call."""
        kv = self.kv
        return EngineCalls(
            register_fingerprint=self.fingerprints.register,
            begin_load=kv.begin_load,
            wait_loaded=kv.loads.wait_loaded,
            release=kv.loads.release,
            release_checked=kv.loads.release_checked,
            plan_save=kv.plan_save,
            commit_save=kv.saves.commit_save,
            abort_save=kv.saves.abort_save,
            stats=self.stats,
            take_events=self.pages.table.take_events,
        )

    def prepare_pages(self, fid: FingerprintId) -> None:
        """Make the host arena for a registered engine's pages now, before it serves (its first
        save would make it, reserving the host tier's whole size in /dev/shm inside the store call
        an engine step waits for: 0.5 s for 2 GiB, past the engine's 2-s deadline for larger
        tiers). `SharedMemoryFull` when /dev/shm cannot hold it."""
        self.pages.host.prepare(self.fingerprints.get(fid).page_nbytes)

    def serve_rpc(self) -> tuple[str, bytes]:
        """Start (once) the local RPC server engine processes use; returns (address, authkey).
        Both are stable for the data directory, so an engine reaches a restarted owner."""
        if self._rpc_server is None:
            address = socket_path_for(self.config.run_dir)
            self._rpc_server = StoreServer(self.engine_calls(), address, self.identity.rpc_authkey())
        return self._rpc_server.address, self._rpc_server.authkey


def _data_dir_in_use(config: StoreConfig) -> DataDirInUse:
    return DataDirInUse(
        f"another process owns the data directory {config.data_dir}: stop that server first, or give "
        "this one another --data-dir"
    )
