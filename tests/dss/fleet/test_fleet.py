"""Several servers on one PostgreSQL database: server ids, page rows per server, membership and
fleet-wide erasure (NOTIFY, catch-up, acknowledgements), concurrent commits from two servers.

Two `Store`s in one process, each with its own data directory, share one throwaway database and
one master key file; the fleet timings are shortened so that every test takes seconds.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select, text

from dss.config import FleetConfig, RemoteConfig, StoreConfig
from dss.db.models import ErasureAckRow, PageDropRow, PageRow, ServerRow
from dss.errors import StaleHead
from dss.fleet.erasures import fleet_report
from dss.store import Store
from dss.types import PageHash, TenantId
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

pytestmark = pytest.mark.pg

FAST = FleetConfig(heartbeat_s=0.2, alive_s=3.0, poll_s=0.5, ack_timeout_s=5.0, reconnect_max_s=0.5)


class Fleet:
    """Opens stores of one fleet under `root`: data dir `root/<name>`, one shared master key."""

    def __init__(self, root: Path, db_url: str) -> None:
        self.root = root
        self.db_url = db_url
        self.open_stores: list[Store] = []

    def open(
        self,
        name: str,
        fleet: FleetConfig = FAST,
        on_tenant_erased: Callable[[TenantId], None] | None = None,
        remote: RemoteConfig | None = None,
    ) -> Store:
        cfg = StoreConfig(
            data_dir=self.root / name,
            db_url=self.db_url,
            master_key_file=self.root / "master.key",
            shm_dir=self.root / "shm",
            server_id=name,
            fleet=fleet,
            codec_process=False,
            fsync=False,
            host_capacity_bytes=1 << 24,
            remote=remote or RemoteConfig(),
        )
        store = Store.open(cfg, on_tenant_erased=on_tenant_erased)
        self.open_stores.append(store)
        return store

    def close_all(self) -> None:
        for s in self.open_stores:
            s.close()


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str) -> Iterator[Fleet]:
    (tmp_path / "shm").mkdir()
    f = Fleet(tmp_path, pg_url)
    try:
        yield f
    finally:
        f.close_all()


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def fill(store: Store, user: str, base: int, n_seq: int = 2) -> list[np.ndarray]:
    """Pages of `user` on `store` (host and disk), `n_seq` sequences of 2 pages each."""
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for(user)
    seqs = []
    for i in range(n_seq):
        tokens = np.arange(base + 100 * i, base + 100 * i + 8, dtype=np.int32)
        put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
        seqs.append(tokens)
    assert store.flush()
    return seqs


def page_files(store: Store, tenant: TenantId) -> int:
    assert store.disk is not None
    return sum(1 for _h, header, _size in store.disk.scan() if header.tenant == tenant)


def rows_of(store: Store, server: str) -> int:
    with store.sf() as s:
        return int(s.scalar(select(func.count()).select_from(PageRow).where(PageRow.server == server)) or 0)


# ------------------------------------------------------------------------------ identity and rows
def test_server_id_is_recorded_in_the_data_dir(tmp_path: Path) -> None:
    store = open_store(tmp_path / "d")
    sid = store.server_id
    assert sid.startswith("srv-") and len(sid) == 16 and int(sid[4:], 16) >= 0
    path = tmp_path / "d" / "server-id"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert store.membership is None and store.follower is None  # SQLite: one server, no fleet
    store.close()
    again = open_store(tmp_path / "d")
    assert again.server_id == sid
    again.close()
    named = open_store(tmp_path / "d", server_id="edge-1")
    assert named.server_id == "edge-1"
    named.close()


def test_two_servers_share_versions_and_keep_their_own_page_rows(fleet: Fleet) -> None:
    a = fleet.open("a")
    fill(a, "alice", 1000)
    info = a.versions.create_session("alice", system_prompt="hi")
    v1 = a.versions.commit("alice", info.id, tokens=[1, 2, 3], messages=[{"role": "user", "content": "x"}])
    n_rows = rows_of(a, "a")
    assert n_rows == 4

    b = fleet.open("b")
    # B's recovery did not take A's rows for rows without a file.
    assert b.recovery_report is not None and b.recovery_report.rows_without_file == 0
    assert rows_of(a, "a") == n_rows
    # A version committed through A is read and continued through B.
    assert b.versions.get_version("alice", info.id, v1.number).tokens.tolist() == [1, 2, 3]
    v2 = b.versions.commit(
        "alice", info.id, tokens=[1, 2, 3, 4], messages=[{"role": "user", "content": "y"}], parent=v1.number
    )
    assert a.versions.get_version("alice", info.id, v2.number).parent == v1.number
    # B's own pages get rows of its own; A restarting recovers all of its own.
    fill(b, "alice", 5000, n_seq=1)
    assert rows_of(b, "b") == 2
    a.close()
    a2 = fleet.open("a")
    assert a2.recovery_report is not None
    assert a2.recovery_report.pages_indexed == n_rows and a2.recovery_report.rows_without_file == 0
    assert rows_of(a2, "b") == 2
    with a2.sf() as s:
        servers = dict(s.execute(select(ServerRow.id, ServerRow.erasure_seq)).all())
    assert servers == {"a": 0, "b": 0}


# ------------------------------------------------------------------------------ fleet-wide erasure
def test_erasure_on_one_server_drops_the_other_servers_pages(fleet: Fleet) -> None:
    erased_on_b: list[TenantId] = []
    a = fleet.open("a")
    b = fleet.open("b", on_tenant_erased=erased_on_b.append)
    fill(a, "alice", 1000)
    bob = fill(b, "bob", 3000, n_seq=1)
    old = b.identity.tenant_for("alice")
    seqs_b = fill(b, "alice", 2000)
    assert page_files(b, old) == 4 and b.pages.table.snapshot(old)

    receipt = a.eraser.erase_user("alice")
    assert receipt.fleet is not None and receipt.fleet.unanswered == ()
    assert set(receipt.fleet.servers) == {"a", "b"}
    assert receipt.fleet.servers["a"]["pages"]["disk"] == 4
    assert (
        receipt.fleet.servers["b"]["pages"]["disk"] == 4 and receipt.fleet.servers["b"]["pages"]["host"] == 4
    )
    assert receipt.counts["page_rows"] == 8  # both servers' rows, in the one transaction
    # B dropped everything of the tenant: table, index, files; and called the hook first.
    assert erased_on_b == [old]
    assert b.pages.table.snapshot(old) == [] and page_files(b, old) == 0
    fid = b.fingerprints.register(SMALL_FP)
    assert all(b.kv.match(fid, old, t).n_tokens == 0 for t in seqs_b)
    assert b.keyring.is_retired(old)
    # B's next tenant of the user (and engine cache salt) is the new epoch's, as on A.
    assert b.identity.tenant_for("alice") == a.identity.tenant_for("alice") != old
    assert b.identity.cache_salt("alice") == str(a.identity.tenant_for("alice"))
    assert b.kv.match(fid, b.identity.tenant_for("bob"), bob[0]).n_tokens == 8  # others untouched
    v = a.eraser.verify(receipt.id)
    assert v.remnants == 0 and v.chain_ok, v.details
    assert a.eraser.get_receipt(receipt.id).fleet == receipt.fleet
    # Both servers advance their erasure_seq (A skips its own receipt: it acknowledged it).
    assert wait_for(lambda: a.membership is not None and a.membership.erasure_seq() == receipt.seq)
    assert b.membership is not None and b.membership.erasure_seq() == receipt.seq
    b.check()


def test_a_stopped_server_is_unanswered_then_catches_up_when_it_is_back(fleet: Fleet) -> None:
    a = fleet.open("a", fleet=FleetConfig(**{**_fast(), "ack_timeout_s": 0.5}))
    b = fleet.open("b")
    tenant = b.identity.tenant_for("carol")
    fill(b, "carol", 1000)
    b.close()  # last_seen stays recent: as if it were killed a moment ago
    assert page_files_at(fleet.root / "b", b) == 4

    receipt = a.eraser.erase_user("carol")
    assert receipt.fleet is not None and receipt.fleet.unanswered == ("b",)
    assert set(receipt.fleet.servers) == {"a"}
    v = a.eraser.verify(receipt.id)
    assert any("server b" in d for d in v.details) and v.remnants >= 1, v.details

    b2 = fleet.open("b")
    assert page_files(b2, tenant) == 0
    report = None

    def acked() -> bool:
        nonlocal report
        report = fleet_report(a.sf, receipt.id)
        return report is not None and report.unanswered == ()

    assert wait_for(acked), report
    assert report is not None and "b" in report.servers
    assert b2.membership is not None and b2.membership.erasure_seq() == receipt.seq
    v = a.eraser.verify(receipt.id)
    assert v.remnants == 0, v.details
    assert b2.identity.tenant_for("carol") == a.identity.tenant_for("carol") != tenant


def test_a_registered_server_that_never_answers_stays_a_remnant(fleet: Fleet) -> None:
    a = fleet.open("a", fleet=FleetConfig(**{**_fast(), "ack_timeout_s": 0.3}))
    with a.sf() as s, s.begin():
        s.add(ServerRow(id="ghost", erasure_seq=0))  # registered a moment ago, never heard from again
    fill(a, "dave", 1000, n_seq=1)
    receipt = a.eraser.erase_user("dave")
    assert receipt.fleet is not None and receipt.fleet.unanswered == ("ghost",)
    v = a.eraser.verify(receipt.id)
    assert v.details == ("server ghost: has not acknowledged the erasure",)


def test_a_dropped_listen_connection_is_survived(fleet: Fleet) -> None:
    a = fleet.open("a")
    b = fleet.open("b")
    assert b.follower is not None
    assert wait_for(lambda: b.follower is not None and b.follower.connects == 1)
    tenant = b.identity.tenant_for("erin")
    fill(b, "erin", 1000)
    with a.db.connect() as c:
        killed = c.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"
                " AND datname = current_database()"
            ),
            {"n": b.follower.application_name},
        ).all()
    assert killed == [(True,)]
    receipt = a.eraser.erase_user("erin")
    # Either it reconnected before the NOTIFY, or its catch-up after reconnecting applies it.
    assert wait_for(lambda: page_files(b, tenant) == 0)
    assert wait_for(lambda: (r := fleet_report(a.sf, receipt.id)) is not None and r.unanswered == ())
    assert b.follower.connects >= 2
    assert a.eraser.verify(receipt.id).remnants == 0


def test_erasures_on_two_servers_at_once_keep_one_chain(fleet: Fleet) -> None:
    a = fleet.open("a")
    b = fleet.open("b")
    fill(a, "u1", 1000, n_seq=1)
    fill(b, "u2", 2000, n_seq=1)
    out: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def erase(store: Store, user: str) -> None:
        barrier.wait()
        out[user] = store.eraser.erase_user(user)

    threads = [threading.Thread(target=erase, args=(s, u)) for s, u in ((a, "u1"), (b, "u2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    seqs = sorted(r.seq for r in out.values())  # type: ignore[attr-defined]
    assert seqs == [1, 2]
    for r in out.values():
        v = a.eraser.verify(r.id)  # type: ignore[attr-defined]
        assert v.chain_ok and v.remnants == 0, v.details
    with a.sf() as s:
        assert (
            s.scalar(select(func.count()).select_from(ErasureAckRow).where(ErasureAckRow.acked_at.is_(None)))
            == 0
        )


def test_erasure_deletes_the_remote_tiers_keys_and_verify_counts_leftovers(fleet: Fleet) -> None:
    import redis

    url = os.environ.get("DSS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis answers at {url}")
    prefix = f"test-fleet-{os.urandom(4).hex()}:"
    try:
        a = fleet.open("a", remote=RemoteConfig(url=url, key_prefix=prefix))
        b = fleet.open("b", remote=RemoteConfig(url=url, key_prefix=prefix))
        tenant = a.identity.tenant_for("fay")
        fill(a, "fay", 1000)
        assert a.remote is not None and a.remote.count_tenant(tenant) == 4
        receipt = a.eraser.erase_user("fay")
        assert a.remote.count_tenant(tenant) == 0
        assert receipt.fleet is not None and "b" in receipt.fleet.servers and receipt.fleet.unanswered == ()
        # A deletes the tenant's keys after its commit, and so does B when it applies the erasure
        # (a late write-behind of its own may have put one back): whichever ran first found the 4.
        by_a, by_b = receipt.counts["remote_keys"], receipt.fleet.servers["b"].get("remote_keys", 0)
        assert by_a + by_b == 4 and receipt.fleet.servers["a"]["remote_keys"] == by_a, (by_a, by_b)
        assert a.eraser.get_receipt(receipt.id).counts["remote_keys"] == by_a  # read back, from A's ack
        assert b.eraser.verify(receipt.id).remnants == 0
        # A copy that reached Redis anyway (a late write-behind elsewhere) is a remnant.
        a.remote.put(PageHash(b"\x07" * 32), tenant, b"unreadable without the data key")
        v = b.eraser.verify(receipt.id)
        assert v.details == ("remote: 1 key(s) of the tenant",), v.details
    finally:
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)


# ------------------------------------------------------------------------------ concurrent commits
def test_concurrent_commits_from_two_servers_on_one_head(fleet: Fleet) -> None:
    a = fleet.open("a")
    b = fleet.open("b")
    sid = a.versions.create_session("alice").id
    a.versions.commit("alice", sid, tokens=[1], messages=[{"role": "user", "content": "0"}])
    for round_ in range(5):
        head = a.versions.get_branch("alice", sid, "main").head_version
        results = _race_pinned_commits((a, b), sid, head)
        won = [r for r in results if isinstance(r, int)]
        lost = [r for r in results if isinstance(r, StaleHead)]
        assert len(won) == 1 and len(lost) == 1, (round_, results)
        assert b.versions.get_branch("alice", sid, "main").head_version == won[0]
    # Without a pinned head both commits land, one on top of the other: no version is lost.
    before = len(a.versions.list_versions("alice", sid))
    barrier2 = threading.Barrier(2)

    def unpinned(store: Store) -> None:
        barrier2.wait()
        store.versions.commit("alice", sid, tokens=[3], messages=[{"role": "user", "content": "z"}])

    threads = [threading.Thread(target=unpinned, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    versions = a.versions.list_versions("alice", sid)
    assert len(versions) == before + 2
    head = a.versions.get_branch("alice", sid, "main").head_version
    assert a.versions.get_version("alice", sid, head).parent == versions[-2].number
    assert a.versions.check() == []


def _race_pinned_commits(stores: tuple[Store, Store], sid: str, head: int) -> list[object]:
    """Both stores commit on `head` at once (pinned): each one's version number or StaleHead."""
    barrier = threading.Barrier(len(stores))
    results: list[object] = []
    lock = threading.Lock()

    def commit(store: Store) -> None:
        barrier.wait()
        try:
            got: object = store.versions.commit(
                "alice",
                sid,
                tokens=[1, 2],
                messages=[{"role": "user", "content": store.server_id}],
                expected_head=head,
            ).number
        except StaleHead as exc:
            got = exc
        with lock:
            results.append(got)

    threads = [threading.Thread(target=commit, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _fast() -> dict[str, float]:
    return {
        "heartbeat_s": FAST.heartbeat_s,
        "alive_s": FAST.alive_s,
        "poll_s": FAST.poll_s,
        "ack_timeout_s": FAST.ack_timeout_s,
        "reconnect_max_s": FAST.reconnect_max_s,
    }


def page_files_at(data_dir: Path, _closed: Store) -> int:
    return sum(1 for _ in (data_dir / "pages").rglob("*.page"))


# ------------------------------------------------------------------------------ fleet-wide deletion
def test_deleting_a_session_on_one_server_drops_the_other_servers_copies(fleet: Fleet) -> None:
    """A session deleted through A: B's host and disk copies of its pages go too (B's follower
    applies A's page drop), with B's page rows; another session's pages of the user stay, and a
    restarted B does not bring the dropped ones back."""
    a = fleet.open("a")
    b = fleet.open("b")
    fid = a.fingerprints.register(SMALL_FP)
    assert b.fingerprints.register(SMALL_FP) == fid
    tenant = a.identity.tenant_for("alice")
    doomed = np.arange(1000, 1008, dtype=np.int32)
    kept = np.arange(2000, 2008, dtype=np.int32)
    for sid, tokens in (("doomed", doomed), ("kept", kept)):
        a.versions.create_session("alice", sid)
        a.versions.commit(
            "alice", sid, tokens=tokens, messages=[{"role": "user", "content": sid}], fingerprint=fid
        )
        put_sequence(b, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
    assert b.flush()
    assert rows_of(b, "b") == 4 and b.kv.match(fid, tenant, doomed).n_tokens == 8

    a.sessions.delete("alice", "doomed")
    assert wait_for(lambda: b.kv.match(fid, tenant, doomed).n_tokens == 0, timeout_s=10.0)
    assert b.kv.match(fid, tenant, kept).n_tokens == 8
    assert rows_of(b, "b") == 2 and page_files(b, tenant) == 2
    b.check()
    b.close()
    b2 = fleet.open("b")
    assert b2.kv.match(fid, tenant, doomed).n_tokens == 0
    assert b2.kv.match(fid, tenant, kept).n_tokens == 8
    # A's next deletion cleans up the row every live server has applied (A stepped over its own).
    assert wait_for(lambda: _page_drop_seqs(b2) == {"a": 1, "b": 1})
    b2.sessions.delete("alice", "kept")
    assert wait_for(lambda: _page_drop_seqs(b2) == {"a": 2, "b": 2})
    with b2.sf() as s:
        assert s.scalars(select(PageDropRow.seq)).all() == [2]


def _page_drop_seqs(store: Store) -> dict[str, int]:
    with store.sf() as s:
        return dict(s.execute(select(ServerRow.id, ServerRow.page_drop_seq)).tuples().all())
