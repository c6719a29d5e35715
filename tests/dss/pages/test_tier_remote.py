"""The remote page tier against a real Redis: batches, corruption, capacity and TTL, erasure by
tenant, Redis going away mid-run; and two stores on one PostgreSQL sharing pages through it.

Redis comes from `DSS_TEST_REDIS_URL` (`.ci/run` starts one); each test writes under its own key
prefix and removes its keys afterwards. The outage test runs its own `redis-server` on a free port.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.config import RemoteConfig
from dss.errors import CorruptPage, PageMissing, TierUnavailable
from dss.index.hashing import chain_hashes, page_hash
from dss.index.tails import tail_hash
from dss.namespace import make_namespace, public_namespace
from dss.pages.codec import make_codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import encode_page
from dss.pages.tiers.remote import RemoteTier
from dss.store import Store
from dss.types import PUBLIC_TENANT, FingerprintId, NamespaceId, PageHash, TenantId, Tier
from tests.api_server import free_port
from tests.store_helpers import SMALL_FP, load_sequence, open_store, page_bytes, pages_for, put_sequence

REDIS_URL = os.environ.get("DSS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
KEY = os.urandom(32)  # an AES-256 data key
CODEC = make_codec("zstd-byteplane")


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


pytestmark = pytest.mark.skipif(not _redis_answers(REDIS_URL), reason=f"no Redis answers at {REDIS_URL}")


def _config(prefix: str, url: str = REDIS_URL, **kw: object) -> RemoteConfig:
    return RemoteConfig(url=url, key_prefix=prefix, **kw)  # type: ignore[arg-type]


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"test-{uuid.uuid4().hex[:8]}:"
    yield p
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{p}*"))
    if keys:
        client.delete(*keys)


def _page(seed: int, tenant: str = "t1") -> tuple[PageMeta, bytes, bytes]:
    raw = page_bytes(SMALL_FP, seed)
    meta = PageMeta(
        hash=PageHash(seed.to_bytes(4, "little") * 8),
        namespace=NamespaceId(b"n" * 16),
        tenant=TenantId(tenant),
        fingerprint=FingerprintId("fp"),
        parent=PageHash(b"\0" * 32),
        index=0,
        nbytes=len(raw),
        tokens=np.arange(SMALL_FP.block_size, dtype=np.int32),
    )
    return meta, raw, encode_page(meta, raw, CODEC, KEY)


def test_put_get_exists_in_batches(prefix: str) -> None:
    tier = RemoteTier(_config(prefix), CODEC)
    pages = [_page(i) for i in range(1, 9)]
    for meta, _raw, blob in pages[:5]:
        assert tier.put(meta.hash, meta.tenant, blob)
    assert not tier.put(pages[0][0].hash, pages[0][0].tenant, pages[0][2])  # already there
    assert tier.exists([m.hash for m, _, _ in pages]) == [True] * 5 + [False] * 3
    for meta, raw, _blob in pages[:5]:
        out = np.zeros(len(raw), dtype=np.uint8)
        header, tokens, _ = tier.read(meta.hash, KEY, out=out)
        assert out.tobytes() == raw and header.page_hash == meta.hash
        assert list(tokens) == list(meta.tokens)
    with pytest.raises(PageMissing):
        tier.get(pages[6][0].hash)
    st = tier.stats()
    assert st.available and st.pages == 5 and st.used_bytes == sum(len(b) for _, _, b in pages[:5])


def test_flipped_bytes_are_a_miss_and_the_value_goes(prefix: str) -> None:
    import redis

    tier = RemoteTier(_config(prefix), CODEC)
    meta, raw, blob = _page(3)
    tier.put(meta.hash, meta.tenant, blob)
    client = redis.Redis.from_url(REDIS_URL)
    key = tier.page_key(meta.hash)
    for offset in (10, len(blob) // 2, len(blob) - 1):  # header, body, tag
        tier.put(meta.hash, meta.tenant, blob)
        value = bytearray(client.get(key) or b"")
        value[offset] ^= 0x40
        client.set(key, bytes(value))
        with pytest.raises(CorruptPage):
            tier.read(meta.hash, KEY, out=np.zeros(len(raw), dtype=np.uint8))
        assert tier.exists([meta.hash]) == [False]  # deleted, never served
    assert tier.corrupt_pages == 3 and tier.stats().used_bytes == 0


def test_capacity_evicts_the_least_recently_used(prefix: str) -> None:
    pages = [_page(i) for i in range(1, 6)]
    size = max(len(blob) for _, _, blob in pages)  # compressed sizes differ by a few bytes
    now = [1000.0]
    # One bucket: the eviction order is then the whole tier's (each bucket evicts its own).
    tier = RemoteTier(_config(prefix, capacity_bytes=3 * size, buckets=1), CODEC, clock=lambda: now[0])
    for meta, _, blob in pages[:3]:
        now[0] += 1
        tier.put(meta.hash, meta.tenant, blob)
    now[0] += 1
    tier.get(pages[0][0].hash)  # page 1 is used again: page 2 is now the oldest
    for meta, _, blob in pages[3:]:
        now[0] += 1
        tier.put(meta.hash, meta.tenant, blob)
    assert tier.exists([m.hash for m, _, _ in pages]) == [True, False, False, True, True]
    assert tier.evictions == 2
    st = tier.stats()
    assert st.pages == 3 and st.used_bytes == sum(len(pages[i][2]) for i in (0, 3, 4))


def test_ttl_expires_pages_and_their_bookkeeping(prefix: str) -> None:
    tier = RemoteTier(_config(prefix, ttl_s=1, buckets=1), CODEC)  # a write sweeps its own bucket
    meta, _, blob = _page(1)
    tier.put(meta.hash, meta.tenant, blob)
    time.sleep(2.1)
    assert tier.exists([meta.hash]) == [False]
    other, _, blob2 = _page(2)
    tier.put(other.hash, other.tenant, blob2)  # a write sweeps expired pages' bookkeeping
    st = tier.stats()
    assert st.pages == 1 and st.used_bytes == len(blob2)


def test_erase_tenant_deletes_its_keys_only(prefix: str) -> None:
    tier = RemoteTier(_config(prefix), CODEC)
    mine = [_page(i, "erased") for i in range(1, 301)]  # more than one chunk
    theirs = [_page(i, "kept") for i in range(1001, 1004)]
    for meta, _, blob in mine + theirs:
        tier.put(meta.hash, meta.tenant, blob)
    assert tier.count_tenant(TenantId("erased")) == 300
    assert tier.erase_tenant(TenantId("erased")) == 300
    assert tier.count_tenant(TenantId("erased")) == 0
    assert not any(tier.exists([m.hash for m, _, _ in mine]))
    assert all(tier.exists([m.hash for m, _, _ in theirs]))
    assert tier.stats().pages == 3


def test_delete_takes_many_pages_in_chunks_with_their_tenant_sets(prefix: str) -> None:
    tier = RemoteTier(_config(prefix), CODEC)
    pages = [_page(i, "t1") for i in range(1, 601)]  # more than two scripts' worth
    for meta, _, blob in pages:
        tier.put(meta.hash, meta.tenant, blob)
    assert tier.delete([m.hash for m, _, _ in pages] + [PageHash(b"\x05" * 32)]) == 600
    assert tier.stats().pages == 0 and tier.count_tenant(TenantId("t1")) == 0
    assert not _tenant_members(prefix, TenantId("t1"))


# ------------------------------------------------------------------------------------ outages
@pytest.fixture
def own_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _redis_answers(url):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield url, proc
    proc.kill()
    proc.wait()


def test_redis_stopped_mid_run_makes_the_tier_unavailable_then_back(
    own_redis: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    url, proc = own_redis
    tier = RemoteTier(_config("o:", url=url, probe_every_s=0.2, timeout_s=0.3), CODEC)
    meta, _, blob = _page(1)
    assert tier.put(meta.hash, meta.tenant, blob)
    proc.kill()
    proc.wait()
    with pytest.raises(TierUnavailable):
        tier.exists([meta.hash])
    assert not tier.available
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable):  # fails fast until the next probe
        tier.get(meta.hash)
    assert time.monotonic() - t0 < 0.05
    # A store whose Redis is gone serves from its local tiers, and says so.
    with open_store(tmp_path / "s", remote=_config("o:", url=url, timeout_s=0.3)) as store:
        fid = store.fingerprints.register(SMALL_FP)
        tenant = store.identity.tenant_for("alice")
        tokens = np.arange(1, 4 * SMALL_FP.block_size + 1, dtype=np.int32)
        assert put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens)) == 4
        store.flush()
        assert load_sequence(store, fid, tenant, tokens)[0] == len(tokens)
        other = np.arange(500, 500 + 2 * SMALL_FP.block_size, dtype=np.int32)
        assert load_sequence(store, fid, tenant, other)[0] == 0  # a miss, not an error
        s = store.stats()
        assert s["remote_available"] is False and s["remote_error"]
        assert s["remote_write_errors"] >= 1
        store.check()


# ------------------------------------------------------------------------- two stores, one fleet
def test_a_page_saved_on_one_server_loads_on_another(pg_url: str, tmp_path: Path, prefix: str) -> None:
    """Server B never saw the sequence: it finds the pages through their content addresses in
    Redis, promotes them into its host tier (not onto its disk: Redis holds them) and gets A's
    bytes."""
    key_file = tmp_path / "master.key"
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": _config(prefix)}
    bs = SMALL_FP.block_size
    tokens = np.arange(1, 5 * bs + 3, dtype=np.int32)  # 5 whole pages and a tail of 2 tokens
    pages = pages_for(SMALL_FP, tokens)
    tail = page_bytes(SMALL_FP, 99)
    with open_store(tmp_path / "a", **common) as a:
        fid = a.fingerprints.register(SMALL_FP)
        tenant = a.identity.tenant_for("alice")
        assert put_sequence(a, fid, tenant, tokens, [*pages, tail]) == 6
        assert a.flush()
        assert a.stats()["remote_writes"] == 6
        with open_store(tmp_path / "b", **common) as b:
            assert b.identity.tenant_for("alice") == tenant
            b.fingerprints.register(SMALL_FP)
            longer = np.concatenate([tokens, np.arange(900, 900 + 2 * bs, dtype=np.int32)])
            n, copies = load_sequence(b, fid, tenant, longer)
            assert n == len(tokens)
            assert copies[:5] == pages and copies[5] == tail
            s = b.stats()
            assert s["hits_pages"][Tier.REMOTE.value] == 6 and s["remote_read_bytes"] > 0
            assert b.flush()
            # Pages the shared tier holds cost B no disk writes (the old code wrote every one).
            residency = b.kv.lookup.residency(fid, tenant, tokens)
            assert residency["disk"] == 0 and residency["host"] == len(tokens), residency
            b.check()
            # Another tenant asking for the same tokens finds nothing of alice's.
            assert load_sequence(b, fid, b.identity.tenant_for("bob"), longer)[0] == 0


# ------------------------------------------------------------------------- deleting a session
class _Chat:
    """A public prefix (2 pages), then alice's sessions "a" and "b" sharing one private page;
    "a" has a page and a tail of its own, and a prompt of it was saved with a tail of its own
    mid-way (a turn's prompt, which no version ends with). Every page is written to Redis."""

    def __init__(self, store: Store) -> None:
        self.fid = store.fingerprints.register(SMALL_FP)
        self.tenant = store.identity.tenant_for("alice")
        system = np.arange(500, 508, dtype=np.int32)
        store.prefixes.register(self.fid, system, text="system prompt", pin=False)
        put_sequence(store, self.fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
        shared = np.concatenate([system, [1, 2, 3, 4]]).astype(np.int32)
        self.a = np.concatenate([shared, [30, 31, 32, 33, 34, 35]]).astype(np.int32)
        prompt = np.concatenate([shared, [30]]).astype(np.int32)
        self.b = np.concatenate([shared, [40]]).astype(np.int32)
        for tokens in (prompt, self.a, self.b):
            whole = pages_for(SMALL_FP, tokens)
            put_sequence(store, self.fid, self.tenant, tokens, [*whole, page_bytes(SMALL_FP, len(tokens))])
        for sid, tokens in (("a", self.a), ("b", self.b)):
            store.versions.create_session("alice", sid)
            store.versions.commit(
                "alice", sid, tokens=tokens, messages=[], branch="main", expected_head=0, fingerprint=self.fid
            )
        assert store.flush()
        own = make_namespace(self.fid, self.tenant).id
        self.public = chain_hashes(public_namespace(self.fid).id, system, 4)
        self.shared = page_hash(own, self.public[-1], shared[8:])
        a_page = page_hash(own, self.shared, self.a[12:16])
        self.a_only = [a_page, tail_hash(own, a_page, self.a[16:]), tail_hash(own, self.shared, prompt[12:])]
        self.b_tail = tail_hash(own, self.shared, self.b[12:])


def _tenant_members(prefix: str, tenant: TenantId) -> set[PageHash]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    members = set().union(*(client.smembers(k) for k in client.scan_iter(f"{prefix}*t:{tenant}")))
    return {PageHash(bytes.fromhex(m.decode())) for m in members}


def test_deleting_a_session_deletes_its_own_pages_from_redis(tmp_path: Path, prefix: str) -> None:
    """Only the pages no remaining version of the user reaches go: the other session's shared
    page and tail stay, and so do the public prefix's pages (no one's)."""
    with open_store(tmp_path, remote=_config(prefix)) as store:
        chat = _Chat(store)
        assert store.remote is not None
        kept = [chat.shared, chat.b_tail]
        assert all(store.remote.exists([*chat.public, *kept, *chat.a_only]))
        assert _tenant_members(prefix, chat.tenant) == {*kept, *chat.a_only}
        store.sessions.delete("alice", "a")
        assert store.remote.exists(chat.a_only) == [False] * 3
        assert all(store.remote.exists([*chat.public, *kept]))
        assert _tenant_members(prefix, chat.tenant) == set(kept)
        assert store.kv.match(chat.fid, chat.tenant, chat.a).n_tokens == 12  # up to the shared page
        store.check()


def test_a_server_that_never_saw_a_session_deletes_its_pages_from_redis(
    pg_url: str, tmp_path: Path, prefix: str
) -> None:
    """The session was served by A; B, whose index holds none of its pages, deletes it: B finds
    the pages in Redis by their content addresses, computed from the versions' tokens."""
    key_file = tmp_path / "master.key"
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": _config(prefix)}
    with open_store(tmp_path / "a", **common) as a:
        chat = _Chat(a)
        with open_store(tmp_path / "b", **common) as b:
            assert b.remote is not None
            b.fingerprints.register(SMALL_FP)
            b.sessions.delete("alice", "a")
            assert b.remote.exists(chat.a_only) == [False] * 3
            assert all(b.remote.exists([*chat.public, chat.shared, chat.b_tail]))
            assert _tenant_members(prefix, chat.tenant) == {chat.shared, chat.b_tail}
            b.check()
