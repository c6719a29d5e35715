"""The remote tier: pages in Redis (or Valkey), shared by every server of a fleet.

A page is stored exactly as the disk tier stores it (`dss.pages.pagefile`: byte-plane zstd,
xxh3 checksums, AES-GCM under the tenant's data key), so Redis never holds plaintext KV and a
value that was damaged in Redis fails its checks on decode and is served as a miss.

Content addressing makes the tier self-indexing: a server that has never seen a session computes
the chained page hashes of a prompt and asks which exist (`exists`, one pipelined round trip).
There is no shared in-memory index and no page row for the remote copies.

Pages are spread over `RemoteConfig.buckets` buckets by their hash, and each bucket keeps its own
bookkeeping under a hash tag, so that every key one script touches lies in one hash slot: the same
keys serve one Redis (or Valkey) and a Redis (or Valkey) Cluster, whose nodes each hold some of
the buckets. Keys (all under `RemoteConfig.key_prefix`, default `dss:`), `{bN}` being bucket N:

    {bN}p:<hash hex>   the page at rest, with a TTL (refreshed on every read and write)
    {bN}t:<tenant>     a set of the tenant's page hashes in the bucket: an erasure walks every
                       bucket's set and deletes them without a scan
    {bN}m              a hash: page hash -> "<bytes at rest> <tenant>"
    {bN}lru            a sorted set: page hash -> last use (unix seconds); the oldest go first
    {bN}bytes          the bytes at rest of the bucket's pages, kept within its share of
                       `capacity_bytes` (pages spread evenly by hash, so the buckets fill evenly)

Eviction is DSS's own, in one layer: each write evicts the least recently used pages of its
bucket past the bucket's share. Redis's `maxmemory` stays above `capacity_bytes` so that Redis
never evicts (`volatile-lru` at most, as a safety net that can only take pages, the keys with a
TTL): an `allkeys-lru` Redis could evict a tenant's set, and an erasure would no longer find that
tenant's pages; pages it evicted would leave their byte counts claiming memory Redis freed.

Writes and evictions run as Lua scripts, so each is atomic on the Redis server: two servers
writing pages concurrently never leave the counters, the sets and the pages disagreeing. Pages
that expired by TTL leave their bookkeeping behind for a while; every write sweeps a few of its
bucket's.

Redis unavailable (refused, timed out, any Redis error) = tier unavailable: the call raises
`TierUnavailable` and further calls fail fast for `probe_every_s`, after which the next call tries
again. The store serves from its local tiers meanwhile and never fails a client for it.

No lock is held while talking to Redis; `_lock` is a leaf around the availability state and the
counters.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from dss.config import RemoteConfig
from dss.errors import CorruptPage, PageMissing, TierUnavailable
from dss.pages.codec import Codec
from dss.pages.pagefile import PageFileHeader, decode_page_of, read_header
from dss.types import PageHash, TenantId, Tier

log = logging.getLogger("dss.pages.remote")

_ERASE_CHUNK = 256
_SWEEP_EXPIRED = 16  # expired pages whose bookkeeping one write removes

# Forget one page: its value and its bookkeeping (size, tenant set, eviction order).
_FORGET_FN = """
local function forget(meta, lru, bytes, prefix, h)
  local m = redis.call('HGET', meta, h)
  if m then
    local size, tenant = string.match(m, '^(%d+) (.*)$')
    redis.call('DECRBY', bytes, tonumber(size))
    redis.call('SREM', prefix .. 't:' .. tenant, h)
    redis.call('HDEL', meta, h)
  end
  redis.call('ZREM', lru, h)
  return redis.call('DEL', prefix .. 'p:' .. h)
end
"""

# KEYS: page, meta, lru, bytes, tenant set. ARGV: blob, ttl, now, hash hex, tenant, capacity,
# prefix, sweep. Returns {stored (0: it was there), pages evicted}.
_PUT = (
    _FORGET_FN
    + """
local meta, lru, bytes = KEYS[2], KEYS[3], KEYS[4]
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[2])
local prefix = ARGV[7]
for _, h in ipairs(redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[8]))) do
  forget(meta, lru, bytes, prefix, h)
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('ZADD', lru, now, ARGV[4])
  return {0, 0}
end
forget(meta, lru, bytes, prefix, ARGV[4])
local size = string.len(ARGV[1])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('HSET', meta, ARGV[4], size .. ' ' .. ARGV[5])
redis.call('ZADD', lru, now, ARGV[4])
redis.call('SADD', KEYS[5], ARGV[4])
local used = redis.call('INCRBY', bytes, size)
local evicted = 0
local cap = tonumber(ARGV[6])
while used > cap do
  local oldest = redis.call('ZRANGE', lru, 0, 0)
  if #oldest == 0 or oldest[1] == ARGV[4] then break end
  forget(meta, lru, bytes, prefix, oldest[1])
  evicted = evicted + 1
  used = tonumber(redis.call('GET', bytes) or '0')
end
return {1, evicted}
"""
)

# KEYS: meta, lru, bytes[, a tenant set]. ARGV: prefix, hash hex... Returns how many pages Redis
# held. With a tenant set (an erasure), each id also leaves that set in the same script, so a page
# another server writes again meanwhile is either gone or still in the set, never orphaned.
_FORGET = (
    _FORGET_FN
    + """
local n = 0
for i = 2, #ARGV do
  n = n + forget(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[i])
  if KEYS[4] then redis.call('SREM', KEYS[4], ARGV[i]) end
end
return n
"""
)


@dataclass(frozen=True, slots=True)
class FetchedPage:
    """A page `read_many` read and verified: its header, token ids and decoded bytes, in the
    destination `ReadInto.take` gave (`slot` its reference: the caller owns it now and settles or
    gives it back), else in a fresh array (`slot` None)."""

    page: PageHash
    header: PageFileHeader
    tokens: np.ndarray
    raw: np.ndarray
    slot: Any = None


class ReadInto(Protocol):
    """Where `read_many` decodes the pages it read (host slots: no copy afterwards)."""

    def take(self, page: PageHash, nbytes: int) -> tuple[Any, np.ndarray] | None:
        """A destination of `nbytes` (its reference, its array), or None (a fresh array)."""
        ...

    def give_back(self, ref: Any) -> None:
        """A destination not handed out after all (the page failed its checks, or was never
        yielded)."""
        ...


@dataclass(frozen=True, slots=True)
class ReadTimes:
    """Seconds spent reading the tier, apart: waiting on Redis (`network`, a batch's pipelined
    round trip) and verifying, decrypting and decompressing (`decode`). Summed over the reader
    threads, so concurrent batches add up."""

    network_s: float = 0.0
    decode_s: float = 0.0
    # Wall-clock seconds of the `read_many` calls, from the first batch sent until the caller
    # took the last page: what a read takes, comparable with a plain client's pipelined GETs
    # (network and decode are summed over the reader threads, which overlap). Concurrent calls
    # add up.
    wall_s: float = 0.0
    batches: int = 0
    pages: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class RemoteStats:
    available: bool
    used_bytes: int
    pages: int
    capacity_bytes: int


class RemoteTier:
    tier = Tier.REMOTE

    def __init__(
        self,
        config: RemoteConfig,
        codec: Codec,
        client_factory: Callable[[RemoteConfig], Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not config.url:
            raise ValueError("the remote tier needs a Redis URL")
        self.config = config
        self.codec = codec  # for pages written here without a disk file to copy (`encode_page`)
        self.capacity_bytes = config.capacity_bytes
        self._prefix = config.key_prefix
        self._buckets = max(1, config.buckets)
        # Each bucket evicts its own oldest pages past its share (pages spread evenly by hash).
        self._bucket_capacity = max(1, config.capacity_bytes // self._buckets)
        self._clock = clock
        self._client = (client_factory or _redis_client)(config)
        self._put_script = self._client.register_script(_PUT)
        self._forget_script = self._client.register_script(_FORGET)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._available = True
        self._last_error = ""
        self.corrupt_pages = 0
        self.errors = 0
        self.evictions = 0
        self._times = ReadTimes()
        # Batches of a `read_many` in flight at once, each a pipelined round trip on a connection
        # of its own (the client's pool), decoded on the thread that read it.
        self._readers = ThreadPoolExecutor(
            max_workers=max(1, config.read_streams), thread_name_prefix="dss-remote-read"
        )

    # --- availability ---------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False after a failed call, until a later call succeeds (tried at most every
        `probe_every_s`)."""
        with self._lock:
            return self._available

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one exchange with Redis; any Redis or socket error makes the tier unavailable."""
        import redis

        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                raise TierUnavailable(f"remote tier unavailable: {self._last_error}")
        try:
            result = fn()
        except (redis.RedisError, OSError) as exc:
            why = f"{what}: {type(exc).__name__}: {exc}"
            with self._lock:
                was = self._available
                self._available = False
                self._last_error = why
                self._down_until = time.monotonic() + self.config.probe_every_s
                self.errors += 1
            if was:
                log.error("remote tier unavailable, serving from local tiers: %s", why)
            raise TierUnavailable(f"remote tier unavailable: {why}") from exc
        with self._lock:
            came_back = not self._available
            self._available = True
        if came_back:
            log.warning("remote tier at %s answers again", _safe_url(self.config.url))
        return result

    def probe(self) -> bool:
        """Whether Redis answers now (a PING; marks the tier available or not)."""
        try:
            return bool(self._call("ping", self._client.ping))
        except TierUnavailable:
            return False

    # --- keys -------------------------------------------------------------------------------------
    def _bucket(self, page: PageHash) -> int:
        return int.from_bytes(page[:4], "little") % self._buckets

    def _tag(self, bucket: int) -> str:
        """The prefix of every key of a bucket: its hash tag puts them all in one slot."""
        return f"{self._prefix}{{b{bucket}}}"

    def _page_key(self, page: PageHash) -> str:
        return f"{self._tag(self._bucket(page))}p:{page.hex()}"

    def page_key(self, page: PageHash) -> str:
        """The Redis key of a page's value (tests and tools that look at Redis directly)."""
        return self._page_key(page)

    def _tenant_key(self, tenant: TenantId, bucket: int) -> str:
        return f"{self._tag(bucket)}t:{tenant}"

    def tenant_keys(self, tenant: TenantId) -> list[str]:
        """The keys of a tenant's page sets, one per bucket."""
        return [self._tenant_key(tenant, b) for b in range(self._buckets)]

    def _meta_key(self, bucket: int) -> str:
        return f"{self._tag(bucket)}m"

    def _lru_key(self, bucket: int) -> str:
        return f"{self._tag(bucket)}lru"

    def _bytes_key(self, bucket: int) -> str:
        return f"{self._tag(bucket)}bytes"

    def _by_bucket(self, pages: Sequence[PageHash]) -> dict[int, list[PageHash]]:
        out: dict[int, list[PageHash]] = {}
        for p in pages:
            out.setdefault(self._bucket(p), []).append(p)
        return out

    def _touch(self, pipe: Any, pages: Sequence[PageHash], now: int) -> None:
        """Queue the pages' new place in their buckets' eviction orders (one ZADD per bucket)."""
        for b, ps in self._by_bucket(pages).items():
            pipe.zadd(self._lru_key(b), {p.hex(): now for p in ps}, xx=True)

    # --- queries ------------------------------------------------------------------------------------
    def exists(self, pages: Sequence[PageHash]) -> list[bool]:
        """Which of `pages` Redis holds now, in one pipelined round trip."""
        if not pages:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for p in pages:
                pipe.exists(self._page_key(p))
            return list(pipe.execute())

        return [bool(n) for n in self._call("exists", run)]

    def stats(self) -> RemoteStats:
        """Bytes and pages held (read from Redis; zeros while unavailable)."""

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for b in range(self._buckets):
                pipe.get(self._bytes_key(b))
                pipe.hlen(self._meta_key(b))
            return list(pipe.execute())

        try:
            got = self._call("stats", run)
        except TierUnavailable:
            return RemoteStats(False, 0, 0, self.capacity_bytes)
        used = sum(int(x or 0) for x in got[0::2])
        return RemoteStats(True, used, sum(int(x or 0) for x in got[1::2]), self.capacity_bytes)

    # --- writing ---------------------------------------------------------------------------------------
    def put(self, page: PageHash, tenant: TenantId, blob: bytes) -> bool:
        """Store a page at rest (`encode_page`'s output, e.g. a disk tier file's bytes). False if
        Redis already held it (its TTL is refreshed). The oldest pages go when over capacity."""
        if len(blob) > self._bucket_capacity:
            return False
        b = self._bucket(page)
        keys = [self._page_key(page), self._meta_key(b), self._lru_key(b), self._bytes_key(b)]
        keys.append(self._tenant_key(tenant, b))
        args = [
            blob,
            self.config.ttl_s,
            int(self._clock()),
            page.hex(),
            tenant,
            self._bucket_capacity,
            self._tag(b),
            _SWEEP_EXPIRED,
        ]
        stored, evicted = self._call("put", lambda: self._put_script(keys=keys, args=args))
        if evicted:
            with self._lock:
                self.evictions += int(evicted)
        return bool(stored)

    def delete(self, pages: Sequence[PageHash]) -> int:
        """Remove pages (and their bookkeeping, their tenant set's member included); returns how
        many Redis held. In scripts of `_ERASE_CHUNK` pages, so none holds Redis up for long
        (a deleted session's addresses may be thousands)."""

        def forget(b: int, chunk: Sequence[PageHash]) -> Callable[[], Any]:
            keys = [self._meta_key(b), self._lru_key(b), self._bytes_key(b)]
            return lambda: self._forget_script(keys=keys, args=[self._tag(b), *(p.hex() for p in chunk)])

        return sum(
            int(self._call("delete", forget(b, ps[lo : lo + _ERASE_CHUNK])))
            for b, ps in self._by_bucket(pages).items()
            for lo in range(0, len(ps), _ERASE_CHUNK)
        )

    # --- reading -----------------------------------------------------------------------------------------
    def get(self, page: PageHash) -> bytes:
        """The page at rest; `PageMissing` when Redis does not hold it (never stored, evicted,
        expired). A read refreshes the page's TTL and its place in the eviction order."""
        key = self._page_key(page)

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.getex(key, ex=self.config.ttl_s)
            self._touch(pipe, [page], int(self._clock()))
            return list(pipe.execute())

        blob = self._call("get", run)[0]
        if blob is None:
            raise PageMissing(f"remote tier does not hold page {page.hex()[:16]}")
        return bytes(blob)

    def read(
        self, page: PageHash, data_key: bytes | None, out: np.ndarray | None = None
    ) -> tuple[PageFileHeader, np.ndarray, bytearray | bytes | memoryview]:
        """The verified page (decoded into `out` when given). A value that fails its checks is
        deleted from Redis and raised as `CorruptPage` (the caller serves a miss)."""
        blob = self.get(page)
        try:
            header, tokens, raw = decode_page_of(blob, page, data_key, out=out)
        except CorruptPage:
            with self._lock:
                self.corrupt_pages += 1
            with contextlib.suppress(TierUnavailable):
                self.delete([page])
            raise
        return header, tokens, raw

    def read_many(
        self,
        pages: Sequence[PageHash],
        data_key: bytes | None,
        *,
        page_nbytes: int = 0,
        stop_at_miss: bool = True,
        batch: int = 0,
        into: ReadInto | None = None,
    ) -> Iterator[FetchedPage | None]:
        """The verified pages, in order, None for each one Redis does not hold (never stored,
        evicted, expired, a value that fails its checks, or Redis not answering): the value's
        absence is the miss, there is no existence round trip before it.

        Pages go in batches of `read_batch` per pipelined round trip (`GETEX` refreshing each
        TTL, and one `ZADD XX` of the batch's eviction order in the same round trip), fewer when
        `page_nbytes` (the pages' size, if known) says they are large (`read_batch_bytes`), with up
        to `read_streams` batches in flight; each batch is decoded on the thread that read it while
        the others are on the wire. `batch` overrides the batch size (a page's tail candidates,
        mostly absent, all go in one round trip). `stop_at_miss`: nothing is yielded after the first miss and
        the batches not yet sent are never sent (a prefix is all a load can use). Closing the
        iterator early cancels the batches not started. `into`: where pages are decoded (every
        destination of a page not yielded is given back)."""
        size = max(1, self.config.read_batch)
        if page_nbytes > 0:
            size = max(1, min(size, self.config.read_batch_bytes // page_nbytes))
        if batch > 0:
            size = batch
        batches = [list(pages[lo : lo + size]) for lo in range(0, len(pages), size)]
        # Twice the reader threads: a thread that finished its batch starts the next at once, even
        # while the caller still waits for an earlier one (the batches are consumed in order).
        window = 2 * max(1, self.config.read_streams)
        pending: list[Future[list[FetchedPage | None]]] = []
        nxt = 0
        got: list[FetchedPage | None] = []
        yielded = 0
        started = time.perf_counter()
        try:
            while nxt < len(batches) or pending:
                while nxt < len(batches) and len(pending) < window:
                    pending.append(self._readers.submit(self._read_batch, batches[nxt], data_key, into))
                    nxt += 1
                got, yielded = pending.pop(0).result(), 0
                for item in got:
                    yielded += 1
                    yield item
                    if item is None and stop_at_miss:
                        return
        finally:
            unused = got[yielded:]
            for f in pending:
                if not f.cancel():  # running or done: its destinations are ours to give back
                    with contextlib.suppress(Exception):
                        unused.extend(f.result())
            if into is not None:
                for item in unused:
                    if item is not None and item.slot is not None:
                        into.give_back(item.slot)
            wall = time.perf_counter() - started
            with self._lock:
                self._times = replace(self._times, wall_s=self._times.wall_s + wall)

    def _read_batch(
        self, batch: list[PageHash], data_key: bytes | None, into: ReadInto | None = None
    ) -> list[FetchedPage | None]:
        """One pipelined round trip for `batch`, then its decoding (on this reader thread)."""
        ttl = self.config.ttl_s
        now = int(self._clock())

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for p in batch:
                pipe.getex(self._page_key(p), ex=ttl)
            self._touch(pipe, batch, now)
            return list(pipe.execute())

        t0 = time.perf_counter()
        try:
            blobs = self._call("read", run)[: len(batch)]
        except TierUnavailable:
            return [None] * len(batch)
        t1 = time.perf_counter()
        out: list[FetchedPage | None] = []
        corrupt: list[PageHash] = []
        nbytes = 0
        for p, blob in zip(batch, blobs, strict=True):
            if blob is None:
                out.append(None)
                continue
            nbytes += len(blob)
            dest: tuple[Any, np.ndarray] | None = None
            try:
                if into is not None:
                    dest = into.take(p, read_header(blob).raw_len)
                if dest is None:
                    header, tokens, _raw = decode_page_of(blob, p, data_key)
                    raw = np.frombuffer(_raw, dtype=np.uint8)
                else:
                    header, tokens, _raw = decode_page_of(blob, p, data_key, out=dest[1])
                    raw = dest[1]
            except CorruptPage as exc:
                if dest is not None and into is not None:
                    into.give_back(dest[0])
                log.warning("page %s unreadable in the remote tier (%s); a miss", p.hex()[:16], exc)
                corrupt.append(p)
                out.append(None)
                continue
            out.append(FetchedPage(p, header, tokens, raw, dest[0] if dest is not None else None))
        t2 = time.perf_counter()
        with self._lock:
            t = self._times
            self._times = ReadTimes(
                t.network_s + (t1 - t0),
                t.decode_s + (t2 - t1),
                t.wall_s,
                t.batches + 1,
                t.pages + sum(1 for x in out if x is not None),
                t.bytes + nbytes,
            )
            self.corrupt_pages += len(corrupt)
        if corrupt:
            with contextlib.suppress(TierUnavailable):
                self.delete(corrupt)
        return out

    def read_times(self) -> ReadTimes:
        """Network and decoding seconds of every `read_many` so far (`/metrics`)."""
        with self._lock:
            return self._times

    # --- erasure -------------------------------------------------------------------------------------------
    def erase_tenant(self, tenant: TenantId) -> int:
        """Delete every page of `tenant` (found through its key set, never by scanning the whole
        keyspace); returns how many pages Redis held. `TierUnavailable` when Redis does not answer:
        the erasure destroyed the tenant's data key, so what is left there can never be decrypted,
        and `count_tenant` (in `verify`) reports it until it is gone."""
        n = 0
        for b in range(self._buckets):  # every bucket: the tenant's pages are spread over them all
            set_key = self._tenant_key(tenant, b)
            while True:
                members = self._srandmember(set_key)
                if not members:
                    break
                hexes = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
                n += self._erase_members(b, set_key, hexes)
        return n

    def _srandmember(self, set_key: str) -> list[Any]:
        return list(self._call("erase", lambda: self._client.srandmember(set_key, _ERASE_CHUNK)) or [])

    def _erase_members(self, bucket: int, set_key: str, hexes: list[str]) -> int:
        """Forget these pages and take them out of the tenant's set, atomically (an empty set is
        deleted by Redis itself)."""
        b = bucket
        keys = [self._meta_key(b), self._lru_key(b), self._bytes_key(b), set_key]
        return int(self._call("erase", lambda: self._forget_script(keys=keys, args=[self._tag(b), *hexes])))

    def _sscan(self, key: str, cursor: int) -> tuple[int, list[bytes]]:
        cursor, members = self._call("count", lambda: self._client.sscan(key, cursor, count=_ERASE_CHUNK))
        return int(cursor), list(members)

    def count_tenant(self, tenant: TenantId) -> int:
        """Pages of `tenant` Redis still holds (`verify` after an erasure)."""
        n = 0
        for b in range(self._buckets):
            key = self._tenant_key(tenant, b)
            cursor = 0
            while True:  # in chunks: a tenant may have many pages
                cursor, members = self._sscan(key, cursor)
                if members:
                    n += sum(self.exists([PageHash(bytes.fromhex(m.decode())) for m in members]))
                if not cursor:
                    break
        return n

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        try:
            self._client.close()
        except Exception:  # closing a client of a dead server must not fail a shutdown
            log.debug("closing the Redis client failed", exc_info=True)


def _redis_client(config: RemoteConfig) -> Any:
    import redis

    if config.cluster:  # a Redis or Valkey Cluster: commands go to the node of their key's slot
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        return RedisCluster.from_url(
            config.url or "",
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            health_check_interval=0,
            retry_on_timeout=False,
            retry=Retry(NoBackoff(), 1),  # a node down is a miss now, not a wait
            require_full_coverage=False,
        )
    return redis.Redis.from_url(
        config.url or "",
        socket_timeout=config.timeout_s,
        socket_connect_timeout=config.timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
    )


def _safe_url(url: str | None) -> str:
    """The URL without a password, for logs."""
    if not url or "@" not in url:
        return url or ""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
