"""Erasures hold against racing writes and against each other (issue 19, items 2 and 3).

A write of a user's rows (a session, a version, a stored response) that races an erasure of that
user either lands before it, and is deleted by it, or after it, and then belongs to the user's next
erasure epoch: no receipt ever finds a remnant, and nothing older than the last erasure survives.
Erasures of one user run one after the other, in one process and across the servers of a fleet,
so each retires its own tenant, and every tenant the user ever had ends with no data key, no
page and no page row.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import event, func, select

from dss.config import FleetConfig, StoreConfig
from dss.db.models import DataKey, PageRow, ResponseRow, SessionRow, VersionRow
from dss.dialogue.response_store import ResponseRecord, new_response_id
from dss.errors import ConflictError, NotFoundError, UserErased
from dss.ops.erasure.receipts import ErasureReceipt
from dss.store import Store
from dss.types import TenantId
from tests.db_helpers import count_user_rows
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

ERASURES = 20
WRITERS = 2


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    overrides: dict[str, object] = {"shm_dir": tmp_path / "shm", "codec_process": False}
    if request.param == "pg":
        overrides["db_url"] = request.getfixturevalue("pg_url")
    s = open_store(tmp_path / "data", **overrides)
    try:
        yield s
    finally:
        s.close()


def _record(user: str, sid: str, version: int) -> ResponseRecord:
    return ResponseRecord(
        id=new_response_id(),
        user=user,
        session_id=sid,
        version=version,
        previous_response_id=None,
        created_at=datetime.now(UTC),
        model="m",
        status="completed",
        instructions=None,
        input_items=[{"type": "message", "role": "user", "content": "my secret"}],
        output=[],
        usage={},
        params={},
    )


def _write_turns(
    store: Store,
    user: str,
    tag: str,
    stop: threading.Event,
    failures: list[BaseException],
    admitted: dict[str, int] | None = None,
) -> None:
    """A session, a version and a stored response, again and again, until `stop`. A step that
    finds its session or version erased (or is refused) starts over. With `admitted`, each turn
    is admitted under the user's epoch first (as the API does) and records it by session id."""
    i = 0
    while not stop.is_set():
        i += 1
        sid = f"{tag}-{i}"
        try:
            if admitted is None:
                store.versions.create_session(user, sid, system_prompt="my secret")
                v = store.versions.commit(
                    user, sid, tokens=[1, 2, 3], messages=[{"role": "user", "content": "x"}]
                )
                store.responses.add(_record(user, sid, v.number))
            else:
                epoch = store.identity.epoch_of(user)
                store.versions.create_session(user, sid, system_prompt="my secret", epoch=epoch)
                admitted[sid] = epoch
                v = store.versions.commit(
                    user, sid, tokens=[1, 2, 3], messages=[{"role": "user", "content": "x"}], epoch=epoch
                )
                store.responses.add(_record(user, sid, v.number), epoch=epoch)
        except (NotFoundError, ConflictError):
            continue
        except BaseException as exc:  # anything else is a failure of the test
            failures.append(exc)
            return


def _rows_created_by(store: Store, user: str, cutoff: datetime) -> dict[str, int]:
    """The user's rows created at or before `cutoff`."""
    out = {}
    with store.sf() as s:
        for name, table in (("sessions", SessionRow), ("versions", VersionRow), ("responses", ResponseRow)):
            out[name] = int(
                s.scalar(
                    select(func.count())
                    .select_from(table)
                    .where(table.user_id == user, table.created_at <= cutoff)
                )
                or 0
            )
    return out


def _assert_receipts_clean(store: Store, receipts: list[ErasureReceipt]) -> None:
    for r in receipts:
        v = store.eraser.verify(r.id)
        assert v.remnants == 0, (r.counts.get("epoch"), v.details)
        assert v.chain_ok


@pytest.mark.parametrize("admit", [False, True], ids=["unadmitted", "admitted"])
def test_writes_racing_erasures_leave_no_remnant(store: Store, admit: bool) -> None:
    """Two threads create sessions, commit versions and store responses for `u` while erasures of
    `u` run: every receipt verifies with no remnant, and nothing created before the last erasure
    survives. (Before: `erased_at` was taken before the erasure's transaction and a session
    created meanwhile survived it: "remnants: 1, session(s) created before the erasure"; on
    PostgreSQL a commit and the erasure's deletes also deadlocked.) Admitted under an epoch, what
    survives was admitted under the last one."""
    user = "race-u"
    stop = threading.Event()
    failures: list[BaseException] = []
    admitted: dict[str, int] | None = {} if admit else None
    writers = [
        threading.Thread(
            target=_write_turns, args=(store, user, f"w{k}", stop, failures, admitted), daemon=True
        )
        for k in range(WRITERS)
    ]
    for t in writers:
        t.start()
    receipts: list[ErasureReceipt] = []
    try:
        for _ in range(ERASURES):
            receipts.append(store.eraser.erase_user(user))
            time.sleep(0.005)
    finally:
        stop.set()
        for t in writers:
            t.join(30)
    assert not failures, failures
    assert [r.counts["epoch"] for r in receipts] == list(range(1, ERASURES + 1))
    assert sum(r.counts["sessions"] for r in receipts) > 0  # the writers did race the erasures
    _assert_receipts_clean(store, receipts)
    assert _rows_created_by(store, user, receipts[-1].erased_at) == {
        "sessions": 0,
        "versions": 0,
        "responses": 0,
    }
    assert store.versions.check() == [] and store.responses.check() == []
    if admitted is not None:
        survivors, _ = store.versions.list_sessions(user, limit=1000)
        assert {admitted[s.id] for s in survivors} <= {ERASURES}


def test_a_write_admitted_before_an_erasure_is_refused_after_it(store: Store) -> None:
    """Every write of a request admitted under an epoch the user has left is refused, the one
    that would create a session included; the re-created user writes under the new epoch."""
    user = "adm-u"
    old = store.identity.epoch_of(user)
    store.versions.create_session(user, "a", epoch=old)
    v = store.versions.commit(
        user, "a", tokens=[1, 2], messages=[{"role": "user", "content": "x"}], epoch=old
    )
    store.responses.add(_record(user, "a", v.number), epoch=old)
    receipt = store.eraser.erase_user(user)
    new = store.identity.epoch_of(user)
    assert new == old + 1 == receipt.counts["epoch"]
    with pytest.raises(UserErased):
        store.versions.create_session(user, "a", epoch=old)
    with pytest.raises(UserErased):
        store.versions.ensure_session(user, "b", epoch=old)
    store.versions.create_session(user, "a", epoch=new)  # the re-created user
    msgs = [{"role": "user", "content": "y"}]
    with pytest.raises(UserErased):
        store.versions.commit(user, "a", tokens=[3], messages=msgs, epoch=old)
    v2 = store.versions.commit(user, "a", tokens=[3], messages=msgs, epoch=new)
    with pytest.raises(UserErased):
        store.responses.add(_record(user, "a", v2.number), epoch=old)
    with pytest.raises(UserErased):
        store.versions.branch(user, "a", v2.number, "side", epoch=old)
    with pytest.raises(UserErased):
        store.versions.rollback(user, "a", "main", v2.number, epoch=old)
    assert count_user_rows(store.sf, user) == {
        "sessions": 1,
        "versions": 1,
        "branches": 1,
        "responses": 0,
    }
    assert store.eraser.verify(receipt.id).remnants == 0


@contextlib.contextmanager
def _paused_before(
    store: Store, statement_start: str, thread_name: str
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the thread `thread_name` just before it executes a statement starting with
    `statement_start`: yields (reached, release)."""
    reached, release = threading.Event(), threading.Event()

    def hook(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if threading.current_thread().name == thread_name and statement.lstrip().startswith(statement_start):
            reached.set()
            release.wait(30)

    event.listen(store.db, "before_cursor_execute", hook)
    try:
        yield reached, release
    finally:
        release.set()
        event.remove(store.db, "before_cursor_execute", hook)


def test_a_session_insert_held_across_an_erasure_is_not_left_behind(store: Store) -> None:
    """The interleaving of the report, forced: a session creation has stamped its time and is held
    just before its INSERT while the user is erased. Its session must not survive as "created
    before the erasure": either the erasure waits for it and deletes it, or it lands after."""
    user = "race-held"
    store.versions.create_session(user, "before")
    created: list[object] = []

    def create() -> None:
        try:
            created.append(store.versions.create_session(user, "held", system_prompt="my secret"))
        except (NotFoundError, ConflictError) as exc:
            created.append(exc)

    with _paused_before(store, "INSERT INTO sessions", "creator") as (reached, release):
        creator = threading.Thread(target=create, name="creator", daemon=True)
        creator.start()
        assert reached.wait(10)
        receipts: list[ErasureReceipt] = []
        eraser = threading.Thread(target=lambda: receipts.append(store.eraser.erase_user(user)), daemon=True)
        eraser.start()
        eraser.join(0.5)  # the old code erased at once; the fenced one waits for the creation
        release.set()
        creator.join(30)
        eraser.join(30)
    assert created and receipts
    v = store.eraser.verify(receipts[0].id)
    assert v.remnants == 0, v.details
    assert _rows_created_by(store, user, receipts[0].erased_at) == {
        "sessions": 0,
        "versions": 0,
        "responses": 0,
    }


def _tenant_left(store: Store, tenant: TenantId) -> dict[str, int]:
    with store.sf() as s:
        rows = s.scalar(select(func.count()).select_from(PageRow).where(PageRow.tenant == tenant))
        keys = s.scalar(select(func.count()).select_from(DataKey).where(DataKey.tenant == tenant))
    files = sum(1 for _h, header, _n in store.disk.scan() if header.tenant == tenant) if store.disk else 0
    return {
        "page_rows": int(rows or 0),
        "data_keys": int(keys or 0),
        "pages": len(store.pages.table.pages_of_tenant(tenant)),
        "files": files,
    }


def _put_kv(store: Store, user: str, stop: threading.Event, failures: list[BaseException]) -> None:
    """KV of `user` under whatever tenant the user has now, as a generation would save it."""
    fid = store.fingerprints.register(SMALL_FP)
    i = 0
    while not stop.is_set():
        i += 1
        tokens = np.arange(1000 * i, 1000 * i + 8, dtype=np.int32)
        try:
            put_sequence(store, fid, store.identity.tenant_for(user), tokens, pages_for(SMALL_FP, tokens))
        except BaseException as exc:
            failures.append(exc)
            return


def _erase_at_once(stores: list[Store], user: str, per_store: int) -> list[ErasureReceipt]:
    n = len(stores) * per_store
    barrier = threading.Barrier(n)
    receipts: list[ErasureReceipt] = []
    failures: list[BaseException] = []

    def erase(s: Store) -> None:
        barrier.wait()
        try:
            receipts.append(s.eraser.erase_user(user))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=erase, args=(s,)) for s in stores for _ in range(per_store)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    return receipts


def _assert_every_old_tenant_retired(stores: list[Store], user: str, receipts: list[ErasureReceipt]) -> None:
    n = len(receipts)
    assert sorted(r.counts["epoch"] for r in receipts) == list(range(1, n + 1))
    tenants = stores[0].identity.tenants_of(user)
    assert len(tenants) == n + 1
    # Each erasure erased the tenant of its own epoch: all of them, each once.
    by_epoch = {r.counts["epoch"]: r.subject for r in receipts}
    assert [by_epoch[e] for e in range(1, n + 1)] == tenants[:-1]
    for s in stores:
        s.flush()
        for t in tenants[:-1]:
            assert s.keyring.is_retired(t)
            assert _tenant_left(s, t) == {"page_rows": 0, "data_keys": 0, "pages": 0, "files": 0}


def test_parallel_erasures_of_one_user_each_retire_their_own_tenant(store: Store) -> None:
    """Four erasures of `bob` at once while his KV is written: epochs 1..4, and each erased the
    tenant of its epoch. (Before: the tenant was computed before any per-user lock, so they all
    erased the first one; the tenants of epochs 1..3 were never retired, and KV written under
    them outlived every receipt.)"""
    user = "par-bob"
    stop = threading.Event()
    failures: list[BaseException] = []
    writer = threading.Thread(target=_put_kv, args=(store, user, stop, failures), daemon=True)
    writer.start()
    try:
        time.sleep(0.05)
        receipts = _erase_at_once([store], user, 4)
    finally:
        stop.set()
        writer.join(30)
    assert not failures, failures
    _assert_every_old_tenant_retired([store], user, receipts)
    _assert_receipts_clean(store, receipts)
    store.check()


FAST = FleetConfig(heartbeat_s=0.2, alive_s=3.0, poll_s=0.5, ack_timeout_s=5.0, reconnect_max_s=0.5)


@pytest.mark.pg
def test_parallel_erasures_of_one_user_on_two_servers(tmp_path: Path, pg_url: str) -> None:
    """Two servers of a fleet erase the same user twice each, all at once: the advisory lock per
    user serialises them across servers too."""
    (tmp_path / "shm").mkdir()
    stores: list[Store] = []
    try:
        for name in ("a", "b"):
            cfg = StoreConfig(
                data_dir=tmp_path / name,
                db_url=pg_url,
                master_key_file=tmp_path / "master.key",
                shm_dir=tmp_path / "shm",
                server_id=name,
                fleet=FAST,
                codec_process=False,
                fsync=False,
                host_capacity_bytes=1 << 24,
            )
            stores.append(Store.open(cfg))
        user = "fleet-carol"
        tokens = np.arange(1, 9, dtype=np.int32)
        for s in stores:
            fid = s.fingerprints.register(SMALL_FP)
            put_sequence(s, fid, s.identity.tenant_for(user), tokens, pages_for(SMALL_FP, tokens))
        receipts = _erase_at_once(stores, user, 2)
        for s in stores:
            assert s.follower is not None
            s.follower.catch_up()
        _assert_every_old_tenant_retired(stores, user, receipts)
        for s in stores:
            _assert_receipts_clean(s, receipts)
    finally:
        for s in stores:
            s.close()
