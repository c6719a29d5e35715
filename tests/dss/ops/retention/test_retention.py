"""Session retention hints and warm-up on a real store: hints persist, `evict` and the idle TTL move
host pages to disk, pinned pages survive host pressure, orphan pages go first, warm-ups promote.
Also migration 0004 on a 0003 database with data, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dss.config import RetentionConfig
from dss.db.connect import current_revision, make_engine, make_session_factory, upgrade_to_head
from dss.dialogue.versions import VersionStore
from dss.errors import InvalidInput, LimitExceeded, PinnedCapExceeded, SessionNotFound, VersionNotFound
from dss.ops.retention import KEEP
from dss.pages.eviction import RetentionClass
from dss.store import Store
from dss.types import FingerprintId, PageHash, Tier
from tests.db_helpers import HEAD_REVISION
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence, seed_one_version

BS = SMALL_FP.block_size
PAGE = SMALL_FP.page_nbytes


def _store(path: Path, host_pages: int = 64, write_through: bool = False, **retention: object) -> Store:
    cfg = RetentionConfig(**{"sweep_interval_s": 0.0, **retention})  # type: ignore[arg-type]
    return open_store(
        path,
        host_capacity_bytes=host_pages * PAGE,
        write_through=write_through,
        codec_process=False,
        retention=cfg,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = _store(tmp_path / "data")
    yield s
    s.close()


def _tokens(start: int, n_pages: int) -> np.ndarray:
    return np.arange(start, start + n_pages * BS, dtype=np.int32)


def turn(store: Store, user: str, sid: str, tokens: np.ndarray, branch: str = "main") -> int:
    """A committed version with its pages stored, as a chat turn leaves them."""
    fid = store.fingerprints.register(SMALL_FP)
    store.versions.ensure_session(user, sid)
    v = store.versions.commit(
        user, sid, tokens=tokens, messages=[{"role": "user", "content": f"{len(tokens)}"}],
        branch=branch, fingerprint=fid,
    )  # fmt: skip
    put_sequence(store, fid, store.identity.tenant_for(user), tokens, pages_for(SMALL_FP, tokens))
    return v.number


def pages_of(store: Store, user: str, tokens: np.ndarray) -> tuple[PageHash, ...]:
    fid = store.fingerprints.register(SMALL_FP)
    return store.kv.match(fid, store.identity.tenant_for(user), tokens).pages


def resident(store: Store, user: str, tokens: np.ndarray) -> dict[str, int]:
    return store.kv.lookup.residency(
        FingerprintId(store.fingerprints.register(SMALL_FP)), store.identity.tenant_for(user), tokens
    )


def klass(store: Store, page: PageHash) -> RetentionClass:
    e = store.pages.table.get(page)
    assert e is not None
    return e.stats.retention


def wait_for(cond: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------------------------------ hints
def test_hint_round_trips_and_persists(tmp_path: Path) -> None:
    s = _store(tmp_path / "d")
    try:
        s.versions.create_session("alice", "trip")
        info = s.retention.set_hint("alice", "trip", "evict", 600)
        assert (info.kv_retention, info.kv_idle_ttl_s) == ("evict", 600)
        info = s.retention.set_hint("alice", "trip", kv_retention="normal")  # the TTL is kept
        assert (info.kv_retention, info.kv_idle_ttl_s) == ("normal", 600)
        assert s.retention.set_hint("alice", "trip", KEEP, None).kv_idle_ttl_s is None
        s.retention.set_hint("alice", "trip", "pinned", 30)
    finally:
        s.close()
    s = _store(tmp_path / "d")
    try:
        got = s.versions.get_session("alice", "trip")
        assert (got.kv_retention, got.kv_idle_ttl_s) == ("pinned", 30)
        listed, _ = s.versions.list_sessions("alice")
        assert [(x.kv_retention, x.kv_idle_ttl_s) for x in listed] == [("pinned", 30)]
        s.versions.create_session("alice", "other")
        assert s.versions.get_session("alice", "other").kv_retention == "normal"
    finally:
        s.close()


def test_bad_values_are_refused_and_change_nothing(store: Store) -> None:
    store.versions.create_session("alice", "trip")
    with pytest.raises(InvalidInput, match="kv_retention"):
        store.retention.set_hint("alice", "trip", "forever")
    with pytest.raises(InvalidInput, match="kv_idle_ttl_s"):
        store.retention.set_hint("alice", "trip", kv_idle_ttl_s=0)
    with pytest.raises(InvalidInput, match="kv_idle_ttl_s"):
        store.retention.set_hint("alice", "trip", kv_idle_ttl_s=True)
    with pytest.raises(LimitExceeded):
        store.retention.set_hint("alice", "trip", kv_idle_ttl_s=10**9)
    with pytest.raises(SessionNotFound):
        store.retention.set_hint("bob", "trip", "evict")  # alice's session is not bob's
    got = store.versions.get_session("alice", "trip")
    assert (got.kv_retention, got.kv_idle_ttl_s) == ("normal", None)


# --------------------------------------------------------------------------------------- demotion
def test_evict_moves_the_sessions_host_pages_to_disk_now(store: Store) -> None:
    a = _tokens(1, 3)
    b = _tokens(1000, 2)
    turn(store, "alice", "trip", a)
    turn(store, "alice", "other", b)
    assert resident(store, "alice", a) == {
        "host": 12,
        "disk": 0,
        "remote": 0,
    }  # only in memory so far
    store.retention.set_hint("alice", "trip", "evict")
    assert resident(store, "alice", a) == {
        "host": 0,
        "disk": 12,
        "remote": 0,
    }  # written back, then moved
    assert resident(store, "alice", b)["host"] == 8  # the other session is untouched
    assert {klass(store, h) for h in pages_of(store, "alice", a)} == {RetentionClass.EVICT}
    assert store.stats()["demoted_pages"] == 3
    fid = store.fingerprints.register(SMALL_FP)
    n, copies = load_sequence(store, fid, store.identity.tenant_for("alice"), a)  # still served, from disk
    assert n == 12 and copies == pages_for(SMALL_FP, a)
    store.check()


def test_a_page_an_active_session_shares_stays_on_the_host(store: Store) -> None:
    shared = _tokens(1, 2)
    turn(store, "alice", "trip", np.concatenate([shared, _tokens(500, 1)]))
    turn(store, "alice", "busy", np.concatenate([shared, _tokens(600, 1)]))
    store.retention.set_hint("alice", "busy", kv_idle_ttl_s=3600)  # tracked, and active
    store.retention.set_hint("alice", "trip", "evict")
    assert resident(store, "alice", shared)["host"] == 8  # the shared pages stay: "busy" uses them
    assert resident(store, "alice", np.concatenate([shared, _tokens(500, 1)]))["disk"] == 4
    assert {klass(store, h) for h in pages_of(store, "alice", shared)} == {RetentionClass.NORMAL}
    store.check()


def test_idle_ttl_sweeper_demotes_after_the_ttl(tmp_path: Path) -> None:
    s = _store(tmp_path / "d", sweep_interval_s=0.05)
    try:
        a, b = _tokens(1, 3), _tokens(1000, 2)
        turn(s, "alice", "idle", a)
        turn(s, "alice", "kept", b)
        s.retention.set_hint("alice", "idle", kv_idle_ttl_s=1)
        began = time.monotonic()
        assert resident(s, "alice", a)["host"] == 12  # not before the TTL
        assert wait_for(lambda: resident(s, "alice", a)["disk"] == 12, 10.0)
        assert time.monotonic() - began >= 0.9
        assert resident(s, "alice", a)["host"] == 0
        assert resident(s, "alice", b)["host"] == 8  # no TTL: stays
        assert s.stats()["retention"]["idle_demotions"] == 1
        # A new turn makes it active again; it is demoted again only after another TTL.
        turn(s, "alice", "idle", np.concatenate([a, _tokens(2000, 1)]))
        assert resident(s, "alice", np.concatenate([a, _tokens(2000, 1)]))["host"] == 4
        assert wait_for(lambda: s.stats()["retention"]["idle_demotions"] == 2, 10.0)
    finally:
        s.close()


def test_demotion_that_cannot_write_to_disk_keeps_the_page(tmp_path: Path) -> None:
    cfg = RetentionConfig(sweep_interval_s=0.0)
    s = open_store(
        tmp_path / "d", host_capacity_bytes=64 * PAGE, write_through=False, disk_capacity_bytes=100,
        codec_process=False, retention=cfg,
    )  # fmt: skip
    try:
        a = _tokens(1, 2)
        turn(s, "alice", "trip", a)
        s.retention.set_hint("alice", "trip", "evict")  # a disk too small for a page: nothing moves
        assert resident(s, "alice", a) == {"host": 8, "disk": 0, "remote": 0}
        assert s.stats()["disk_full_skips"] == 2
        s.check()
    finally:
        s.close()


# ------------------------------------------------------------------------------------------- pins
def test_pinned_pages_survive_host_pressure_that_evicts_normal_ones(tmp_path: Path) -> None:
    s = _store(tmp_path / "d", host_pages=8, pinned_fraction=0.5, pinned_user_fraction=0.5)
    try:
        hot, cold = _tokens(1, 3), _tokens(1000, 3)
        turn(s, "alice", "hot", hot)
        turn(s, "alice", "cold", cold)
        s.retention.set_hint("alice", "hot", "pinned")
        assert {klass(s, h) for h in pages_of(s, "alice", hot)} == {RetentionClass.PINNED}
        for i in range(6):  # 12 more pages through an 8-page host tier
            turn(s, "alice", f"filler{i}", _tokens(5000 + 100 * i, 2))
        assert resident(s, "alice", hot) == {"host": 12, "disk": 0, "remote": 0}
        split = resident(s, "alice", cold)
        assert split["host"] < 12 and split["host"] + split["disk"] == 12
        assert s.stats()["pages"]["host"] == 8  # full: the rest were evicted around the pinned ones
        assert s.stats()["retention"]["pinned_bytes"] == 3 * PAGE
        s.retention.set_hint("alice", "hot", "normal")  # unpinned: evictable again
        assert {klass(s, h) for h in pages_of(s, "alice", hot)} == {RetentionClass.NORMAL}
        s.check()
    finally:
        s.close()


def test_pinning_beyond_the_caps_is_refused(tmp_path: Path) -> None:
    s = _store(tmp_path / "d", host_pages=8, pinned_fraction=0.5, pinned_user_fraction=0.25)
    try:
        turn(s, "alice", "big", _tokens(1, 3))  # 3 pages > 2 pages per user
        turn(s, "alice", "small", _tokens(1000, 2))
        turn(s, "bob", "b", _tokens(3000, 2))
        turn(s, "carol", "c", _tokens(4000, 1))
        with pytest.raises(PinnedCapExceeded, match="per user"):
            s.retention.set_hint("alice", "big", "pinned")
        assert s.versions.get_session("alice", "big").kv_retention == "normal"
        s.retention.set_hint("alice", "small", "pinned")
        s.retention.set_hint("bob", "b", "pinned")  # 4 pages pinned: the global cap
        with pytest.raises(PinnedCapExceeded, match="all sessions"):
            s.retention.set_hint("carol", "c", "pinned")
        s.retention.set_hint("bob", "b", "normal")
        s.retention.set_hint("carol", "c", "pinned")
    finally:
        s.close()


# ---------------------------------------------------------------------------------------- orphans
def test_pages_of_versions_no_branch_leads_to_go_first(tmp_path: Path) -> None:
    s = _store(tmp_path / "d", host_pages=8)
    try:
        old = _tokens(1, 3)
        turn(s, "alice", "other", old)  # least recently used: plain LRU would evict it first
        v1 = _tokens(1000, 2)
        turn(s, "alice", "trip", v1)
        v2 = np.concatenate([v1, _tokens(2000, 2)])
        turn(s, "alice", "trip", v2)
        s.versions.rollback("alice", "trip", "main", 1)  # version 2 is off every branch now
        s.retention.sweeper.sweep()  # the rollback updated the session: reclassified
        v2_only = pages_of(s, "alice", v2)[2:]
        assert [klass(s, h) for h in v2_only] == [RetentionClass.ORPHAN] * 2
        assert {klass(s, h) for h in pages_of(s, "alice", v1)} == {RetentionClass.NORMAL}
        turn(s, "bob", "new", _tokens(7000, 3))  # 3 pages into a host tier with 1 free
        assert [s.pages.fastest_tier(h) for h in v2_only] == [Tier.DISK, Tier.DISK]
        assert resident(s, "alice", old)["host"] == 12  # older, but reachable: kept
        # A branch at version 2 makes its pages reachable again.
        s.versions.branch("alice", "trip", 2, "again")
        s.retention.sweeper.sweep()
        assert [klass(s, h) for h in v2_only] == [RetentionClass.NORMAL] * 2
        s.check()
    finally:
        s.close()


# ------------------------------------------------------------------------------------------ warm-up
def test_warm_promotes_a_versions_disk_pages_to_host(store: Store) -> None:
    a = _tokens(1, 3)
    turn(store, "alice", "trip", a)
    store.retention.set_hint("alice", "trip", "evict")
    plan = store.retention.warmer.warm("alice", "trip")
    assert (plan.version, plan.pages, plan.tokens) == (1, 3, 12)
    assert plan.resident == {"host": 0, "disk": 12, "remote": 0}
    assert plan.warming_pages + plan.already_warming == 3
    assert store.retention.warmer.idle(10)
    assert resident(store, "alice", a) == {"host": 12, "disk": 12, "remote": 0}
    again = store.retention.warmer.warm("alice", "trip", version=1)
    assert (again.warming_pages, again.resident["host"]) == (0, 12)  # nothing left to warm
    assert store.stats()["retention"]["warmed_pages"] == 3
    store.check()


def test_warm_of_an_empty_branch_or_a_missing_version(store: Store) -> None:
    store.versions.create_session("alice", "empty")
    plan = store.retention.warmer.warm("alice", "empty")
    assert (plan.version, plan.pages, plan.warming_pages) == (0, 0, 0)
    with pytest.raises(VersionNotFound):
        store.retention.warmer.warm("alice", "empty", version=9)
    with pytest.raises(SessionNotFound):
        store.retention.warmer.warm("bob", "empty")


def test_after_a_restart_pinned_sessions_are_warmed(tmp_path: Path) -> None:
    s = _store(tmp_path / "d", write_through=True)
    a = _tokens(1, 3)
    try:
        turn(s, "alice", "hot", a)
        s.retention.set_hint("alice", "hot", "pinned")
        s.flush()
    finally:
        s.close()
    s = _store(tmp_path / "d", sweep_interval_s=0.05)
    try:
        assert wait_for(lambda: resident(s, "alice", a)["host"] == 12, 10.0)  # from disk, by the sweeper
        assert {klass(s, h) for h in pages_of(s, "alice", a)} == {RetentionClass.PINNED}
    finally:
        s.close()


def test_deleting_and_erasing_forget_the_session(store: Store) -> None:
    turn(store, "alice", "trip", _tokens(1, 2))
    turn(store, "bob", "b", _tokens(1, 2))
    store.retention.set_hint("alice", "trip", "evict")
    store.retention.set_hint("bob", "b", kv_idle_ttl_s=60)
    assert store.retention.stats()["tracked_sessions"] == 2
    store.sessions.delete("alice", "trip")
    store.eraser.erase_user("bob")
    assert wait_for(lambda: store.retention.stats()["tracked_sessions"] == 0, 5.0)


# --------------------------------------------------------------------------------------- migration
def test_0004_upgrades_a_0003_database_with_data_in_it(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config

    command.upgrade(alembic_config(db_url), "0003")
    engine = make_engine(db_url)
    try:
        seed_one_version(engine)
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD_REVISION
        vs = VersionStore(make_session_factory(engine))
        got = vs.get_session("alice", "trip")
        assert (got.kv_retention, got.kv_idle_ttl_s, got.version_count) == ("normal", None, 1)
        assert vs.get_version("alice", "trip", 1).tokens.tolist() == [1, 2]
        assert vs.check() == []
        vs.set_retention("alice", "trip", "evict", 120)
        assert [
            (h.session_id, h.kv_retention, h.kv_idle_ttl_s) for h in vs.retention_hints(hinted_only=True)
        ] == [("trip", "evict", 120)]
    finally:
        engine.dispose()


def test_eviction_goes_class_by_class_then_by_the_policy() -> None:
    from dss.pages.eviction import LRUPolicy, PageStats, choose_victims

    def st(age: float, c: RetentionClass) -> PageStats:
        return PageStats(last_access=100.0 - age, hits=1, created=0.0, index=0, nbytes=1, retention=c)

    pages = {
        "old_normal": st(90, RetentionClass.NORMAL),
        "new_orphan": st(1, RetentionClass.ORPHAN),
        "new_evict": st(2, RetentionClass.EVICT),
        "old_evict": st(50, RetentionClass.EVICT),
        "pinned": st(99, RetentionClass.PINNED),
        "new_normal": st(3, RetentionClass.NORMAL),
    }
    cands = [(PageHash(n.encode().ljust(32, b"\0")), s) for n, s in pages.items()]
    order = [v.rstrip(b"\0").decode() for v in choose_victims(cands, LRUPolicy(), 100.0, 10**6)]
    assert order == ["new_orphan", "old_evict", "new_evict", "old_normal", "new_normal"]


def test_a_warm_up_blocked_on_disk_blocks_no_request(store: Store) -> None:
    """The promotion of a warm-up is paused inside its disk read: `warm` has answered already, a
    second warm-up of the same version queues nothing, and hints of other sessions still apply."""
    a, b = _tokens(1, 2), _tokens(1000, 2)
    turn(store, "alice", "trip", a)
    turn(store, "alice", "other", b)
    store.retention.set_hint("alice", "trip", "evict")
    assert store.disk is not None
    disk = store.disk
    inside, release = threading.Event(), threading.Event()
    real_read = disk.read

    def paused_read(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(20)
        return real_read(*args, **kwargs)

    disk.read = paused_read  # type: ignore[method-assign]
    try:
        began = time.monotonic()
        plan = store.retention.warmer.warm("alice", "trip")
        assert plan.warming_pages == 2 and time.monotonic() - began < 2.0
        assert inside.wait(10)
        again = store.retention.warmer.warm("alice", "trip")
        assert (again.warming_pages, again.already_warming) == (0, 2)
        began = time.monotonic()
        store.retention.set_hint("alice", "other", "evict")  # the worker is not the warmers
        assert time.monotonic() - began < 3.0
        assert resident(store, "alice", b)["host"] == 0
    finally:
        release.set()
        disk.read = real_read  # type: ignore[method-assign]
    assert store.retention.warmer.idle(10)
    assert resident(store, "alice", a)["host"] == 8
    store.check()


# ------------------------------------------------------------------------------ review fixes
def test_a_hint_the_busy_worker_does_not_reach_is_withdrawn(tmp_path: Path) -> None:
    """A hint still queued after `wait_s` is cancelled: `RetentionBusy`, and it is never applied."""
    from dss.errors import RetentionBusy

    s = _store(tmp_path / "d", wait_s=0.3)
    try:
        a = _tokens(1, 2)
        turn(s, "alice", "trip", a)
        release = threading.Event()
        blocker = s.retention.worker.submit(release.wait, 20)  # the worker busy with other work
        try:
            with pytest.raises(RetentionBusy):
                s.retention.set_hint("alice", "trip", "evict")
        finally:
            release.set()
        blocker.result(10)
        s.retention.worker.submit(lambda: None).result(10)  # whatever was queued has run
        assert s.versions.get_session("alice", "trip").kv_retention == "normal"  # told it failed: it did
        assert resident(s, "alice", a)["host"] == 8
    finally:
        s.close()


def test_a_hint_gets_in_between_the_sessions_of_a_sweep(tmp_path: Path) -> None:
    """The sweep's sessions are separate jobs: a hint waits for one of them, not for the sweep."""
    # Margins sized for a loaded CI machine: one session's job takes ~0.5 s, the whole sweep
    # ~3.5 s, and the hint may wait 1.5 s, so it passes only by getting in between sessions.
    s = _store(tmp_path / "d", wait_s=1.5)
    try:
        for i in range(6):
            turn(s, "alice", f"s{i}", _tokens(100 * i + 1, 1))
        turn(s, "bob", "b", _tokens(5000, 1))
        real = s.versions.list_versions

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return real(*args, **kwargs)

        s.versions.list_versions = slow  # type: ignore[method-assign]
        sweeper = threading.Thread(target=s.retention.sweeper.sweep)
        sweeper.start()
        time.sleep(0.1)
        s.retention.set_hint("bob", "b", kv_idle_ttl_s=600)  # the sweep alone takes 3.5 s
        sweeper.join(20)
        assert s.versions.get_session("bob", "b").kv_idle_ttl_s == 600
    finally:
        s.close()


def test_a_refresh_matches_branch_heads_and_orphan_leaves_only(tmp_path: Path) -> None:
    s = _store(tmp_path / "d")
    try:
        seq = _tokens(1, 1)
        for i in range(8):  # eight versions, each a prefix of the next
            seq = np.concatenate([seq, _tokens(1000 + 100 * i, 1)])
            turn(s, "alice", "trip", seq)
        calls: list[int] = []
        real = s.kv.match

        def counted(fid: Any, tenant: Any, tokens: Any) -> Any:
            calls.append(len(tokens))
            return real(fid, tenant, tokens)

        s.kv.match = counted  # type: ignore[method-assign]
        s.retention.set_hint("alice", "trip", kv_idle_ttl_s=600)
        assert calls == [len(seq)]  # the head only, not every version
        v4 = seq[: 5 * BS]
        s.versions.rollback("alice", "trip", "main", 4)
        calls.clear()
        s.retention.sweeper.sweep()
        assert sorted(calls) == [len(v4), len(seq)]  # the head, and the one leaf off every branch
        s.kv.match = real  # type: ignore[method-assign]
        assert {klass(s, h) for h in pages_of(s, "alice", v4)} == {RetentionClass.NORMAL}
        assert {klass(s, h) for h in pages_of(s, "alice", seq)[5:]} == {RetentionClass.ORPHAN}
    finally:
        s.close()


def test_sessions_updated_at_is_indexed(tmp_path: Path) -> None:
    from sqlalchemy import inspect

    from dss.db.connect import sqlite_url_for

    url = sqlite_url_for(tmp_path / "db")
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        indexes = {ix["name"]: ix["column_names"] for ix in inspect(engine).get_indexes("sessions")}
        assert indexes.get("ix_sessions_updated_at") == ["updated_at"]
    finally:
        engine.dispose()


def test_the_registry_keeps_nothing_of_a_normal_session_but_its_orphans(tmp_path: Path) -> None:
    s = _store(tmp_path / "d")
    try:
        turn(s, "alice", "plain", _tokens(1, 3))
        s.retention.sweeper.sweep()
        assert s.retention.stats()["tracked_sessions"] == 0  # its pages keep the default class
        assert s.retention.stats()["tracked_pages"] == 0
        v1 = _tokens(1000, 1)
        turn(s, "alice", "trip", v1)
        turn(s, "alice", "trip", np.concatenate([v1, _tokens(2000, 2)]))
        s.versions.rollback("alice", "trip", "main", 1)
        s.retention.sweeper.sweep()
        assert s.retention.stats()["tracked_sessions"] == 1
        assert s.retention.stats()["tracked_pages"] == 2  # the two orphan pages, nothing else
    finally:
        s.close()


def test_orphans_of_normal_sessions_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dss.ops.retention.registry as registry_mod

    monkeypatch.setattr(registry_mod, "_MAX_ORPHAN_ONLY_PAGES", 3)
    s = _store(tmp_path / "d")
    try:
        orphans = {}
        for i, sid in enumerate(("old", "new")):
            v1 = _tokens(1000 * (i + 1), 1)
            v2 = np.concatenate([v1, _tokens(1000 * (i + 1) + 500, 2)])
            turn(s, "alice", sid, v1)
            turn(s, "alice", sid, v2)
            s.versions.rollback("alice", sid, "main", 1)
            s.retention.sweeper.sweep()
            orphans[sid] = pages_of(s, "alice", v2)[1:]
        assert s.retention.stats()["tracked_sessions"] == 1  # 4 orphan pages > 3: the older went
        assert [klass(s, h) for h in orphans["new"]] == [RetentionClass.ORPHAN] * 2
        assert [klass(s, h) for h in orphans["old"]] == [RetentionClass.NORMAL] * 2
    finally:
        s.close()


def test_a_warm_up_racing_an_erasure_records_nothing_for_the_user(store: Store) -> None:
    turn(store, "alice", "trip", _tokens(1, 2))
    store.retention.set_hint("alice", "trip", kv_idle_ttl_s=600)  # tracked
    real = store.versions.get_version

    def then_erased(*args: Any, **kwargs: Any) -> Any:
        v = real(*args, **kwargs)  # read before the erasure ...
        store.eraser.erase_user("alice")
        store.retention.worker.submit(lambda: None).result(10)  # ... forgotten before the touch
        return v

    store.versions.get_version = then_erased  # type: ignore[method-assign]
    store.retention.warmer.warm("alice", "trip", version=1)
    store.versions.get_version = real  # type: ignore[method-assign]
    assert store.retention.warmer.idle(10)
    assert store.retention.registry.last_use(("alice", "trip")) is None
    assert store.retention.stats()["tracked_sessions"] == 0


def test_public_prefix_pages_are_never_classed_or_demoted(store: Store) -> None:
    """A version that ends inside a public prefix's tail page: neither that page nor the public
    whole page is given the session's class or moved to disk."""
    from dss.types import PUBLIC_TENANT

    fid = store.fingerprints.register(SMALL_FP)
    system = np.arange(500, 500 + BS + 2, dtype=np.int32)  # one whole page and a tail
    store.prefixes.register(fid, system, text="system prompt", pin=True)
    public_pages = [*pages_for(SMALL_FP, system), pages_for(SMALL_FP, _tokens(9000, 1))[0]]
    put_sequence(store, fid, PUBLIC_TENANT, system, public_pages)
    m = store.kv.match(fid, store.identity.tenant_for("alice"), system)
    assert m.n_tokens == len(system) and len(m.pages) == 2  # the public tail page matches
    turn(store, "alice", "trip", system)
    store.retention.set_hint("alice", "trip", "evict")
    assert [klass(store, h) for h in m.pages] == [RetentionClass.NORMAL] * 2
    assert [store.pages.fastest_tier(h) for h in m.pages] == [Tier.HOST] * 2


def test_demote_to_disk_leaves_pinned_pages_alone(store: Store) -> None:
    a = _tokens(1, 2)
    turn(store, "alice", "trip", a)
    pages = pages_of(store, "alice", a)
    store.pages.table.set_pinned(pages[:1], True)  # as a public prefix's pin does
    assert store.pages.demoter.demote_to_disk(pages, []) == 1
    assert [store.pages.fastest_tier(h) for h in pages] == [Tier.HOST, Tier.DISK]
    store.check()
