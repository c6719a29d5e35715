"""Reading the remote tier at wire speed (issue 30, item 1), against a real Redis: a turn's pages
go in batches per pipelined round trip with several in flight, the value's absence is the miss
(no `EXISTS` round trip first), network and decoding are timed apart, and a prefetch started when
a turn's target is resolved brings the pages into the host tier before the engine's load asks.

Redis comes from `DSS_TEST_REDIS_URL` (`.ci/run` starts one); each test writes under its own key
prefix and removes its keys afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dss.config import RemoteConfig
from dss.pages.tiers import remote as remote_module
from dss.pages.tiers.remote import RemoteTier
from dss.types import Tier
from tests.dss.pages.test_tier_remote import CODEC, KEY, REDIS_URL, _config, _page, _redis_answers, prefix
from tests.store_helpers import SMALL_FP, load_sequence, open_store, page_bytes, pages_for, put_sequence

pytestmark = pytest.mark.skipif(not _redis_answers(REDIS_URL), reason=f"no Redis answers at {REDIS_URL}")

__all__ = ["prefix"]  # the fixture, shared with test_tier_remote


class _Counting:
    """A Redis client that records the commands of every pipelined round trip."""

    def __init__(self, inner: Any, log: list[list[str]]) -> None:
        self._inner = inner
        self.log = log

    def pipeline(self, transaction: bool = False) -> Any:
        pipe = self._inner.pipeline(transaction=transaction)
        execute = pipe.execute

        def counted(*args: Any, **kw: Any) -> Any:
            self.log.append([str(c[0][0]).upper() for c in pipe.command_stack])
            return execute(*args, **kw)

        pipe.execute = counted
        return pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _counting_factory(log: list[list[str]]) -> Callable[[RemoteConfig], Any]:
    real = remote_module._redis_client
    return lambda config: _Counting(real(config), log)


def test_read_many_pipelines_batches_and_a_missing_value_is_the_miss(prefix: str) -> None:
    log: list[list[str]] = []
    tier = RemoteTier(_config(prefix, read_batch=4, read_streams=2), CODEC, _counting_factory(log))
    pages = [_page(i) for i in range(1, 11)]
    for i, (meta, _raw, blob) in enumerate(pages):
        if i != 6:
            assert tier.put(meta.hash, meta.tenant, blob)
    log.clear()
    got = list(tier.read_many([m.hash for m, _, _ in pages], KEY, stop_at_miss=False))
    assert [g is None for g in got] == [i == 6 for i in range(10)]
    for g, (meta, raw, _blob) in zip(got, pages, strict=True):
        if g is not None:
            assert g.page == meta.hash and g.raw.tobytes() == raw
    # Three round trips of at most four values each, the eviction order touched in the same one
    # (a ZADD per bucket of the batch's pages).
    assert len(log) == 3 and all(0 < rt.count("ZADD") <= rt.count("GETEX") <= 4 for rt in log)
    assert all(set(rt) == {"GETEX", "ZADD"} for rt in log), log
    times = tier.read_times()
    assert times.batches == 3 and times.pages == 9 and times.network_s > 0 and times.decode_s > 0

    log.clear()
    first = list(tier.read_many([m.hash for m, _, _ in pages], KEY))  # stops at the first miss
    assert len(first) == 7 and first[-1] is None and all(g is not None for g in first[:6])
    assert len(log) <= 2 + 1  # the batches after the miss are not read (one may be on the wire)
    tier.close()


def test_a_damaged_value_is_a_miss_and_leaves_redis(prefix: str) -> None:
    import redis

    tier = RemoteTier(_config(prefix), CODEC)
    meta, _raw, blob = _page(1)
    assert tier.put(meta.hash, meta.tenant, blob)
    damaged = bytearray(blob)
    damaged[-5] ^= 0xFF
    redis.Redis.from_url(REDIS_URL).set(tier.page_key(meta.hash), bytes(damaged))
    assert list(tier.read_many([meta.hash], KEY)) == [None]
    assert tier.corrupt_pages == 1 and tier.exists([meta.hash]) == [False]
    tier.close()


def _shared_sequence(a: Any, n_pages: int) -> tuple[Any, Any, np.ndarray, list[bytes]]:
    bs = SMALL_FP.block_size
    fid = a.fingerprints.register(SMALL_FP)
    tenant = a.identity.tenant_for("alice")
    tokens = np.arange(1, n_pages * bs + 3, dtype=np.int32)  # whole pages and a tail of 2 tokens
    pages = [*pages_for(SMALL_FP, tokens), page_bytes(SMALL_FP, 99)]
    assert put_sequence(a, fid, tenant, tokens, pages) == n_pages + 1
    assert a.flush()
    return fid, tenant, tokens, pages


def test_a_load_on_another_server_reads_its_pages_in_few_round_trips_without_exists(
    pg_url: str, tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Server B loads 20 pages and a tail it never saw: three round trips of 8 values (the miss
    after the last page is in the last one) and one for the tail candidates; never an EXISTS,
    never one round trip per page."""
    key_file = tmp_path / "master.key"
    remote = _config(prefix, read_batch=8, read_streams=3)
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": remote}
    bs = SMALL_FP.block_size
    with open_store(tmp_path / "a", **common) as a:
        fid, tenant, tokens, pages = _shared_sequence(a, 20)
        log: list[list[str]] = []
        monkeypatch.setattr(remote_module, "_redis_client", _counting_factory(log))
        with open_store(tmp_path / "b", **common) as b:
            b.fingerprints.register(SMALL_FP)
            log.clear()
            longer = np.concatenate([tokens, np.arange(900, 900 + 2 * bs, dtype=np.int32)])
            n, copies = load_sequence(b, fid, tenant, longer)
            assert n == len(tokens) and copies == pages
            reads = [rt for rt in log if "GETEX" in rt or "EXISTS" in rt]
            assert not any("EXISTS" in rt for rt in reads), reads
            assert len(reads) <= 4, [len(rt) for rt in reads]
            s = b.stats()
            assert s["hits_pages"][Tier.REMOTE.value] == 21
            assert s["remote_read_pages"] == 21 and s["remote_read_batches"] == len(reads)
            phases = s["remote_read_seconds"]
            assert phases["network"] > 0 and phases["decode"] > 0 and phases["promote"] > 0
            # The reads' wall-clock time: the phases overlap on the reader threads, so it is at
            # most their sum (plus the handing over between threads).
            wall = s["remote_read_wall_seconds"]
            assert 0 < wall <= phases["network"] + phases["decode"] + 0.05, (wall, phases)
            b.check()
            # The same in /metrics, apart.
            from api.metrics import Metrics

            metrics = Metrics()
            metrics.watch_store(b.stats)
            text = metrics.render().decode()
            for phase in ("network", "decode", "promote"):
                line = next(
                    ln
                    for ln in text.splitlines()
                    if ln.startswith(f'dss_remote_read_seconds_total{{phase="{phase}"}}')
                )
                assert float(line.split()[-1]) > 0
            walls = [ln for ln in text.splitlines() if ln.startswith("dss_remote_read_wall_seconds_total ")]
            assert [float(ln.split()[-1]) for ln in walls] == [wall]
            assert (
                "dss_remote_read_batches_total" in text
                and 'dss_remote_prefetch_total{outcome="started"}' in text
            )


def _prefetched(b: Any, fid: Any, tenant: Any, tokens: np.ndarray) -> None:
    """Server `b` prefetches `tokens`' pages from the remote tier; returns once all are in its
    host tier."""
    b.fingerprints.register(SMALL_FP)
    assert b.kv.loads.prefetch(fid, tenant, tokens)
    deadline = time.monotonic() + 10
    while b.kv.lookup.residency(fid, tenant, tokens)["host"] < len(tokens):
        assert time.monotonic() < deadline, "the prefetch did not bring the pages"
        time.sleep(0.01)


def test_a_prefetch_brings_a_turns_pages_into_the_host_tier_before_the_load(
    pg_url: str, tmp_path: Path, prefix: str
) -> None:
    key_file = tmp_path / "master.key"
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": _config(prefix)}
    with open_store(tmp_path / "a", **common) as a:
        fid, tenant, tokens, pages = _shared_sequence(a, 6)
        with open_store(tmp_path / "b", **common) as b:
            _prefetched(b, fid, tenant, tokens)
            plan = b.kv.begin_load(fid, tenant, tokens)
            assert plan is not None and not plan.is_async  # every page in the host tier already
            # ... and reported as read from the remote tier (where this turn's KV came from) ...
            assert plan.tier_tokens == {"host": 0, "disk": 0, "remote": plan.n_tokens}
            assert all(ps.slot is not None and ps.tier == "remote" for ps in plan.pages)
            b.kv.loads.release(plan.load_id)
            again = b.kv.begin_load(fid, tenant, tokens)  # ... once: the next load is a host hit
            assert again is not None and again.tier_tokens["host"] == again.n_tokens
            b.kv.loads.release(again.load_id)
            s = b.stats()
            assert s["prefetch_started"] == 1 and s["prefetch_pages"] == len(pages)
            b.check()
        # A budget smaller than the turn's pages: nothing is started, and it is counted.
        small = _config(prefix, prefetch_max_bytes=SMALL_FP.page_nbytes)
        with open_store(tmp_path / "c", db_url=pg_url, master_key_file=key_file, remote=small) as c:
            c.fingerprints.register(SMALL_FP)
            assert not c.kv.loads.prefetch(fid, tenant, tokens)
            assert c.stats()["prefetch_skipped"] == 1
            assert c.kv.lookup.residency(fid, tenant, tokens)["host"] == 0


def test_the_next_turns_load_after_a_prefetch_reads_nothing_more_from_redis(
    pg_url: str, tmp_path: Path, prefix: str
) -> None:
    """The prefetch brought the previous turn's pages, its tail page too; the load of the next
    turn's prompt (that history and a few new tokens) finds them all here and reads no page from
    Redis again (it read the tail page a second time: 3 MB on every cross-server turn)."""
    key_file = tmp_path / "master.key"
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": _config(prefix)}
    with open_store(tmp_path / "a", **common) as a:
        fid, tenant, tokens, pages = _shared_sequence(a, 6)
        with open_store(tmp_path / "b", **common) as b:
            _prefetched(b, fid, tenant, tokens)
            read = b.stats()["remote_read_pages"]
            assert read == len(pages)
            next_turn = np.concatenate([tokens, np.arange(900, 905, dtype=np.int32)])
            plan = b.kv.begin_load(fid, tenant, next_turn)
            assert plan is not None and not plan.is_async and plan.n_tokens == len(tokens)
            b.kv.loads.release(plan.load_id)
            assert b.stats()["remote_read_pages"] == read
            b.check()


def test_pages_read_past_a_missing_one_give_their_host_slots_back(
    pg_url: str, tmp_path: Path, prefix: str
) -> None:
    """A page missing in the middle ends the load there; the pages after it that were already on
    the wire (decoded into host slots reserved for them) give those slots back."""
    key_file = tmp_path / "master.key"
    remote = _config(prefix, read_batch=2, read_streams=4)
    common = {"db_url": pg_url, "master_key_file": key_file, "remote": remote}
    bs = SMALL_FP.block_size
    with open_store(tmp_path / "a", **common) as a:
        fid, tenant, tokens, pages = _shared_sequence(a, 12)
        assert a.remote is not None
        gap = a.kv.lookup.stored_prefix(fid, tenant, tokens).pages[4]
        assert a.remote.delete([gap]) == 1
        with open_store(tmp_path / "b", **common) as b:
            b.fingerprints.register(SMALL_FP)
            n, copies = load_sequence(b, fid, tenant, tokens)
            assert n == 4 * bs and copies == pages[:4]
            b.check()  # every host slot is a page's (none left reserved by the reads past the gap)
            assert b.stats()["remote_read_pages"] > 4  # pages past the gap were read, then let go
