"""Store configuration: a plain dataclass (the API builds it from pydantic-settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dss.jsonlimits import JsonLimits

GiB = 1 << 30
# Entries of each in-memory key cache (erasure epochs by user, unwrapped data keys by tenant):
# ~100 bytes per epoch and ~150 per data key, so the default costs about 16 MiB at most.
DEFAULT_CACHE_ENTRIES = 65_536


@dataclass(frozen=True, slots=True)
class Quotas:
    """Limits per user on the dialogue state (`dss.dialogue.quotas` checks them); 0 turns one off."""

    max_sessions: int = 10_000
    max_versions: int = 100_000
    max_stored_bytes: int = 4 * GiB
    # What a client over quota is told to wait: until an operator raises it or it deletes data.
    retry_after_s: int = 3600


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Session retention hints and warm-up (`dss.ops.retention`)."""

    # How often the sweeper reclassifies updated sessions and demotes idle ones (0: no sweeper
    # thread; `SessionRetention.sweeper.sweep()` can still be called).
    sweep_interval_s: float = 5.0
    # Caps on the bytes `pinned` sessions may keep in the host tier, as fractions of its capacity:
    # all users together, and each user.
    pinned_fraction: float = 0.5
    pinned_user_fraction: float = 0.25
    warm_threads: int = 2  # promotions of warm-ups run on this many threads
    max_warm_pages: int = 4096  # pages queued for warming at once; more are not warmed
    sessions_per_sweep: int = 1000  # sessions reclassified per sweep (the rest wait for the next)
    wait_s: float = 30.0  # how long a request waits for its session's reclassification


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The remote page tier (`dss.pages.tiers.remote`): Redis (or Valkey) shared by a fleet."""

    url: str | None = None  # redis://host:port/db; None: no remote tier
    # A Redis (or Valkey) Cluster: `url` names one of its nodes (redis://host:port), the client
    # learns the others and sends each key to the node of its slot.
    cluster: bool = False
    # Pages spread over this many buckets, each with its own bookkeeping under a hash tag (one
    # slot of a cluster) and its own share of `capacity_bytes` to evict within.
    buckets: int = 16
    key_prefix: str = "dss:"  # every key this store writes starts with it
    capacity_bytes: int = 8 * GiB  # page bytes (at rest) kept in Redis; the oldest go first
    ttl_s: int = 7 * 24 * 3600  # a page not read or written for this long expires
    timeout_s: float = 0.5  # socket connect/read deadline: a slow Redis is an unavailable one
    probe_every_s: float = 2.0  # how often an unavailable Redis is tried again
    write_behind: bool = True  # committed pages are copied to Redis by the background writer
    # A turn's version is committed (and answered) only once its pages were written behind, so
    # the session's next turn on any server finds them (`KVCache.wait_shared`); at most this
    # long, then it is committed anyway and counted (`dss_shared_tier_waits_total{outcome}`).
    # 0: do not wait (a server that dies right after a reply may take its last pages with it).
    durable_wait_s: float = 5.0
    # A read (`RemoteTier.read_many`) asks for up to `read_batch` pages per pipelined round trip,
    # fewer when pages are large: as many as fit in `read_batch_bytes` (at least one), since a
    # batch is decoded only once all of it arrived. `read_streams` batches are in flight at once,
    # each decoded as it arrives while the others are on the wire (bench/remote_read.py).
    read_batch: int = 16
    read_batch_bytes: int = 1 << 20
    read_streams: int = 2
    # How pages are encoded for Redis (always encrypted and checksummed): a codec name
    # (`dss.pages.codec`), "none" or "zstd-byteplane[:level]". Chosen by `bench/remote_read.py`:
    # uncompressed pages decode with a third of zstd's CPU and were delivered as fast or faster in
    # most runs; zstd keeps 1.45x more pages in the same Redis memory (docs/operations.md).
    codec: str = "none"
    # Prefetch (`KVLoads.prefetch`, started when a turn's target is resolved): pages read ahead
    # into the host tier at most this many bytes (uncompressed) at a time; more are not prefetched.
    prefetch_max_bytes: int = 512 << 20


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Several servers on one PostgreSQL database (`dss.fleet`); unused with SQLite."""

    heartbeat_s: float = 2.0  # how often a server refreshes its `servers.last_seen`
    alive_s: float = 10.0  # a server seen within this long is alive (an erasure waits for its ack)
    poll_s: float = 3.0  # catch-up on erasure receipts and page drops this often, besides notifications
    ack_timeout_s: float = 5.0  # how long an erasure waits for the acks of the servers alive then
    reconnect_max_s: float = 5.0  # the listener's reconnect backoff grows up to this


@dataclass(frozen=True, slots=True)
class StoreConfig:
    data_dir: Path
    db_url: str | None = None  # default: SQLite in data_dir
    master_key_file: Path | None = None  # default: data_dir/master.key (env DSS_MASTER_KEY wins)
    create_master_key: bool = True  # embedded default: generate on first start (with a warning)
    # A server (`dss serve`): DSS_MASTER_KEY leaves the process environment once the key is read,
    # before any child process starts (the engine's, the page codec's); they never need it.
    forget_env_master_key: bool = False
    host_capacity_bytes: int = 2 * GiB
    disk_capacity_bytes: int = 20 * GiB
    shm_dir: Path | None = None  # where the host tier makes its private directory; default /dev/shm
    codec: str = "zstd-byteplane"
    eviction_policy: str = "cost"
    write_through: bool = True
    fsync: bool = True
    loader_threads: int = 2
    # Encode/decode page files in a helper process (off this process's GIL, so lookups and RPC
    # threads never wait behind compression and encryption); False: in the calling thread.
    codec_process: bool = True
    max_tokens_per_sequence: int = 1 << 20
    lease_timeout_s: float = 600.0  # a load or save not finished by then is presumed dead
    # Bounds of the in-memory key caches (least recently used dropped first; read again from the
    # database when needed): users' erasure epochs (`Identity`) and unwrapped data keys
    # (`Keyring`). User ids are chosen by frontends, so neither may grow with them.
    identity_cache_entries: int = DEFAULT_CACHE_ENTRIES
    data_key_cache_entries: int = DEFAULT_CACHE_ENTRIES
    quotas: Quotas = field(default_factory=Quotas)  # per user: sessions, versions, stored bytes
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    # Depth and size of every free-form JSON value the store keeps (metadata, tool calls, ...).
    json_limits: JsonLimits = field(default_factory=JsonLimits)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    # This server's name in a fleet (page rows of its local tiers, erasure acknowledgements);
    # None: the one recorded in data_dir/server-id (a random one is written on first start).
    server_id: str | None = None
    fleet: FleetConfig = field(default_factory=FleetConfig)

    @property
    def resolved_db_url(self) -> str:
        from dss.db.connect import sqlite_url_for

        return self.db_url or sqlite_url_for(self.data_dir)

    @property
    def resolved_key_file(self) -> Path:
        return self.master_key_file or (self.data_dir / "master.key")

    @property
    def disk_dir(self) -> Path:
        return self.data_dir / "pages"

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def owner_lock_path(self) -> Path:
        return self.run_dir / "owner.lock"
