"""The store RPC on its own: real unix sockets, a fake service, every wait bounded."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dss.derive import hmac_sha256, rpc_authkey
from dss.errors import DSSError, SessionNotFound
from dss.namespace import ModelFingerprint
from dss.rpc import (
    ENGINE_CALLS,
    EngineStore,
    StoreClient,
    StoreServer,
    StoreTimeout,
    StoreUnavailable,
    socket_path_for,
)
from dss.types import FingerprintId, PageHash, SessionId, TenantId
from dss.wire import LoadPlan, PageSlot, PlannedLoad, SavePlan, SessionTag, SlotRef, tokens_digest

KEY = rpc_authkey(b"s" * 32)
FP = ModelFingerprint(
    model_id="tiny", revision="r1", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=8, block_size=4
)
SLOT = SlotRef("/dev/shm/arena", 4096, 3, 16)
PAGE = PageSlot(0, PageHash(b"h0" * 16), SLOT)


class FakeService:
    """Canned answers; records what it was called with. `gate` (when set) makes `begin_load`
    block until it is released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.gate: threading.Event | None = None

    def last_call(self) -> tuple[str, tuple[Any, ...]]:
        return self.calls[-1]

    def register_fingerprint(self, fp: ModelFingerprint) -> FingerprintId:
        self.calls.append(("register_fingerprint", (fp,)))
        return FingerprintId(fp.id)

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int,
        max_tokens: int,
    ) -> LoadPlan | None:
        self.calls.append(("begin_load", (fid, tenant, tokens, start_token, max_tokens)))
        if self.gate is not None:
            self.gate.wait(10.0)
        if len(tokens) == 0:
            return None
        return LoadPlan("L1", 4, start_token, (PAGE,), False, {"host": 4})

    def wait_loaded(self, load_id: str, timeout_s: float) -> tuple[PageSlot | None, ...]:
        self.calls.append(("wait_loaded", (load_id, timeout_s)))
        if load_id == "slow":
            time.sleep(timeout_s)
        return (PAGE, None)

    def release(self, load_id: str, *, shard: int | None = None) -> None:
        self.calls.append(("release", (load_id, shard)))

    def release_checked(self, load_id: str, *, shard: int | None = None) -> int:
        self.calls.append(("release_checked", (load_id, shard)))
        return 1

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        *,
        with_tail: bool = False,
    ) -> SavePlan:
        self.calls.append(("plan_save", (fid, tenant, tokens, n_pages, with_tail)))
        return SavePlan("S1", (PAGE,))

    def commit_save(self, save_id: str, written: Sequence[int], *, shard: int = 0) -> int:
        self.calls.append(("commit_save", (save_id, written, shard)))
        return len(written)

    def abort_save(self, save_id: str, *, shard: int | None = None) -> None:
        self.calls.append(("abort_save", (save_id, shard)))
        if save_id == "missing":
            raise SessionNotFound("no such save")
        if save_id == "bug":
            raise ValueError("not a domain error")

    def stats(self) -> Mapping[str, Any]:
        return {"leases": 0}


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def address(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "s.sock")


@pytest.fixture
def server(service: FakeService, address: str) -> Iterator[StoreServer]:
    srv = StoreServer(service, address, KEY, handshake_timeout_s=1.0)
    yield srv
    srv.close()


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    c = StoreClient(server.address, KEY, timeout_s=2.0, connect_timeout_s=1.0)
    yield c
    c.close()


def test_the_fake_is_a_store_service(service: FakeService) -> None:
    svc: EngineStore = service  # checked by mypy; at run time just a smoke test
    assert svc.stats() == {"leases": 0}


def test_every_method_round_trips(client: StoreClient, service: FakeService) -> None:
    assert client.ping()
    fid = client.register_fingerprint(FP)
    assert fid == FP.id
    assert service.calls[-1] == ("register_fingerprint", (FP,))

    plan = client.begin_load(fid, "t1", [1, 2, 3, 4, 5], 0, 8)
    assert isinstance(plan, LoadPlan)
    assert plan == LoadPlan("L1", 4, 0, (PAGE,), False, {"host": 4})
    assert isinstance(plan.pages[0], PageSlot) and isinstance(plan.pages[0].slot, SlotRef)
    name, args = service.last_call()
    got_fid, tenant, tokens, start, max_tokens = args
    assert (name, got_fid, tenant, start, max_tokens) == ("begin_load", fid, "t1", 0, 8)
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int32
    assert tokens.tolist() == [1, 2, 3, 4, 5]
    assert client.begin_load(fid, "t1", [], 0, 8) is None

    assert client.wait_loaded("L1", 1.5) == (PAGE, None)
    assert service.calls[-1] == ("wait_loaded", ("L1", 1.5))

    client.release("L1")
    assert service.calls[-1] == ("release", ("L1", None))
    assert client.release_checked("L1", shard=1) == 1
    assert service.calls[-1] == ("release_checked", ("L1", 1))

    save = client.plan_save(fid, "t1", np.arange(8, dtype=np.int64), 2)
    assert save == SavePlan("S1", (PAGE,))
    saved_tokens = service.last_call()[1][2]
    assert isinstance(saved_tokens, np.ndarray) and saved_tokens.dtype == np.int32
    assert client.commit_save("S1", (0, 1)) == 2
    assert service.calls[-1] == ("commit_save", ("S1", [0, 1], 0))
    assert client.commit_save("S1", (0,), shard=3) == 1
    assert service.calls[-1] == ("commit_save", ("S1", [0], 3))
    client.abort_save("S1")
    assert service.calls[-1] == ("abort_save", ("S1", None))
    with pytest.raises(DSSError, match="shard"):
        client.abort_save("S1", shard=-1)
    assert client.stats() == {"leases": 0}
    assert (client.failures, client.timeouts) == (0, 0)


def test_the_kernel_bounds_are_set_once_per_connection_and_lowered_for_a_shorter_call(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting a connection's kernel send/recv bounds takes six syscalls: calls with the same
    budget keep the bound set (issue 31: two sets on every hot turn's path), one with a shorter
    budget lowers it (no syscall may outlast a deadline), and a new connection sets its own."""
    import dss.rpc.client as client_module

    bounds: list[float] = []
    real = client_module.set_conn_timeouts

    def counted(conn: Any, seconds: float) -> None:
        bounds.append(seconds)
        real(conn, seconds)

    monkeypatch.setattr(client_module, "set_conn_timeouts", counted)
    client = StoreClient(server.address, KEY, timeout_s=5.0)
    for _ in range(20):
        assert client.ping()
        assert client.release_checked("L1", shard=0) == 1
    assert len(bounds) == 1 and 4.0 <= bounds[0] <= 5.0
    assert client.ping(timeout_s=0.5)
    assert len(bounds) == 2 and bounds[1] <= 0.5
    assert client.ping()  # a long budget again: raised, within it
    assert len(bounds) == 3 and 0.5 < bounds[2] <= 5.0
    client.close()
    assert client.ping()  # reconnected: the new socket gets its bound
    assert len(bounds) == 4
    client.close()


def test_socket_is_private(server: StoreServer, address: str) -> None:
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(address).parent).st_mode) == 0o700


def test_a_hung_owner_times_out_then_backs_off_then_is_reconnected(
    server: StoreServer, service: FakeService
) -> None:
    client = StoreClient(server.address, KEY, timeout_s=5.0, backoff_s=1.0)
    assert client.ping()
    service.gate = threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout):
            client.begin_load(FingerprintId("f"), "t", [1, 2, 3, 4], 0, 4, timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert 0.45 <= elapsed < 1.5
        assert (client.timeouts, client.failures) == (1, 1)

        t0 = time.monotonic()  # backing off: fails fast without touching the owner
        with pytest.raises(StoreUnavailable) as info:
            client.ping()
        assert not isinstance(info.value, StoreTimeout)
        assert time.monotonic() - t0 < 0.1
        assert (client.timeouts, client.failures) == (1, 2)
    finally:
        service.gate.set()
    service.gate = None
    time.sleep(1.05)
    assert client.begin_load(FingerprintId("f"), "t", [1, 2, 3, 4], 0, 4) is not None
    assert (client.timeouts, client.failures) == (1, 2)
    client.close()


def test_wait_loaded_deadline_is_its_own_timeout_plus_grace(server: StoreServer) -> None:
    client = StoreClient(server.address, KEY, timeout_s=0.2, wait_grace_s=1.0)
    assert client.wait_loaded("slow", 0.5) == (PAGE, None)  # longer than timeout_s: not a timeout
    assert client.timeouts == 0
    client.close()


def test_a_listener_that_never_answers_the_challenge_does_not_hang_the_client(tmp_path: Path) -> None:
    address = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    try:
        client = StoreClient(address, KEY, timeout_s=5.0, connect_timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            client.ping()
        assert time.monotonic() - t0 < 1.5
        assert client.failures == 1
        client.close()
    finally:
        stop.set()
        thread.join(2.0)
        for s in held:
            s.close()
        listener.close()


def test_a_silent_client_does_not_block_others(server: StoreServer, client: StoreClient) -> None:
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.settimeout(3.0)
    silent.connect(server.address)
    try:
        time.sleep(0.1)  # the server has accepted it and waits for its answer
        t0 = time.monotonic()
        other = StoreClient(server.address, KEY, timeout_s=0.5)
        assert other.ping()
        assert client.ping()
        assert time.monotonic() - t0 < 0.5
        other.close()
        # the silent one is hung up once the handshake timeout (1 s here) passes
        data = b""
        while chunk := silent.recv(4096):
            data += chunk
        assert data  # the challenge it never answered
    finally:
        silent.close()


def test_wrong_authkey_is_rejected_and_the_server_keeps_serving(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    bad = StoreClient(server.address, b"not the key", timeout_s=1.0)
    with caplog.at_level(logging.WARNING, logger="dss.rpc"), pytest.raises(StoreUnavailable):
        bad.ping()
    assert bad.failures == 1 and bad.timeouts == 0
    good = StoreClient(server.address, KEY, timeout_s=1.0)
    assert good.ping()
    deadline = time.monotonic() + 1.0
    while "rejected an RPC connection" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "rejected an RPC connection" in caplog.text
    bad.close()
    good.close()


def test_close_hangs_up_and_the_same_client_reaches_a_new_server(
    server: StoreServer, client: StoreClient, address: str
) -> None:
    assert client.ping()
    server.close()
    assert not os.path.exists(address)
    with pytest.raises(StoreUnavailable) as info:
        client.ping()
    assert not isinstance(info.value, StoreTimeout)  # a hang-up is not a timeout: no backoff
    second = StoreServer(FakeService(), address, KEY)
    try:
        assert client.ping()
        assert client.stats() == {"leases": 0}
    finally:
        second.close()


def test_remote_errors_come_back_with_their_name(client: StoreClient) -> None:
    with pytest.raises(DSSError, match=r"^SessionNotFound: no such save$") as info:
        client.abort_save("missing")
    assert not isinstance(info.value, StoreUnavailable)
    with pytest.raises(DSSError, match=r"^ValueError: not a domain error$"):
        client.abort_save("bug")
    with pytest.raises(DSSError, match="unknown RPC method"):
        client._call("no_such_method")
    assert client.ping()  # the connection is still usable
    assert client.failures == 0


def test_rpc_authkey_is_stable_and_secret_dependent() -> None:
    assert rpc_authkey(b"s" * 32) == KEY
    assert len(KEY) == 32
    assert rpc_authkey(b"t" * 32) != KEY
    with pytest.raises(ValueError):
        rpc_authkey(b"")


def test_a_deep_run_dir_gets_a_short_private_socket_path(tmp_path: Path, service: FakeService) -> None:
    # A data directory deep enough that run/store.sock is over the 107-byte unix-socket limit:
    # the store must still serve its engines (it crashed at start before), at a stable path.
    run_dir = tmp_path / ("d" * 60) / ("e" * 60) / "run"
    address = socket_path_for(run_dir)
    assert len(os.fsencode(address)) <= 107 and address == socket_path_for(run_dir)
    folder = Path(address).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    server = StoreServer(service, address, b"k" * 32)
    try:
        c = StoreClient(address, b"k" * 32, timeout_s=2.0)
        try:
            assert c.ping()
        finally:
            c.close()
    finally:
        server.close()
    # Planted by someone else (here: made group/world-accessible): refused, never used.
    folder.chmod(0o777)
    with pytest.raises(StoreUnavailable, match="not a private folder"):
        socket_path_for(run_dir)
    folder.chmod(0o700)
    short = tmp_path / "run"
    assert socket_path_for(short) == str(short / "store.sock")


def test_a_failure_is_counted_after_the_connection_lock_is_released(tmp_path: Path) -> None:
    """Locks are leaves: the failure counters' lock is never taken while the connection's is held."""
    client = StoreClient(str(tmp_path / "nobody.sock"), KEY, timeout_s=0.5, backoff_s=5.0)
    connection_held: list[bool] = []

    class Probe:
        def __enter__(self) -> None:
            connection_held.append(client._lock.locked())

        def __exit__(self, *exc: object) -> None:
            return None

    client._count_lock = Probe()  # type: ignore[assignment]
    for _ in range(2):  # a refused connection, then (no backoff for it) a second one
        with pytest.raises(StoreUnavailable):
            client.ping(timeout_s=0.5)
    assert connection_held and not any(connection_held)


def test_one_contract_the_owners_the_client_and_the_server_follow(tmp_path: Path) -> None:
    """`EngineStore` is the one list of what an engine may call: the server's method table, the
    client's methods and the owner's table (`Store.engine_calls`) hold exactly its calls, and
    each part that answers one takes the contract's parameters (names, order, defaults)."""
    import inspect

    from tests.store_helpers import open_store

    contract = {n for n, v in vars(EngineStore).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert set(ENGINE_CALLS) == contract
    served = {n for n, v in vars(StoreClient).items() if inspect.isfunction(v) and not n.startswith("_")}
    served -= {"ping", "close"}
    assert served == contract
    store = open_store(tmp_path / "d", shm_dir=tmp_path / "shm")
    try:
        calls = store.engine_calls()
        for name in contract:
            want = inspect.signature(getattr(EngineStore, name)).parameters
            got = inspect.signature(getattr(calls, name)).parameters
            expected = [p for p in want.values() if p.name != "self"]
            assert [p.name for p in got.values()][: len(expected)] == [p.name for p in expected], name
            for p in expected:  # a default of the contract is the owner's default too
                assert p.default is p.empty or got[p.name].default == p.default, (name, p.name)
        address, key = store.serve_rpc()
        client = StoreClient(address, key, timeout_s=5.0)
        try:
            assert client.stats()["leases"] == 0
        finally:
            client.close()
    finally:
        store.close()


def test_a_planned_load_travels_signed_for_its_session_and_as_plain_values_only() -> None:
    """A load planned by the API's store rides in the request's `kv_transfer_params`
    (`SessionTag.to_params`): read back only under the session's key, for that very tenant and
    session, and unpickled as plain values only (no class, not even the plan's own) even when its
    signature verifies."""
    key = b"k" * 32
    ref = SlotRef("/dev/shm/dss-1/arena", 4096, 7, 64, 3)
    pages = (PageSlot(0, PageHash("a" * 32), ref), PageSlot(1, PageHash("b" * 32), ref))
    plan = LoadPlan("L9", 8, 0, pages, False, {"host": 8}, 8)
    planned = PlannedLoad("fp1", tokens_digest(range(9)), plan)
    tag = SessionTag(TenantId("t1"), SessionId("s1"))
    params = tag.to_params(key, planned)
    assert SessionTag.from_params(params, key) == tag and tag.planned_load(params, key) == planned
    assert tag.planned_load(tag.to_params(key), key) is None  # none was planned
    assert tag.planned_load(params, b"x" * 32) is None  # another key
    assert SessionTag(TenantId("t2"), SessionId("s1")).planned_load(params, key) is None
    assert SessionTag(TenantId("t1"), SessionId("s2")).planned_load(params, key) is None
    blob = params["load_plan"]
    tampered = {**params, "load_plan": blob.replace(b"/dev/shm/dss-1", b"/dev/shm/dss-2")}
    assert tag.planned_load(tampered, key) is None
    # Signed with the right key yet holding a class (another one, or the plan's own as the
    # layout before this one pickled it), or plain values of another layout: refused all the same.
    for evil in (
        pickle.dumps(PlannedLoad("fp1", "d", datetime.date(2026, 1, 1)), pickle.HIGHEST_PROTOCOL),  # type: ignore[arg-type]
        pickle.dumps(planned, pickle.HIGHEST_PROTOCOL),
        pickle.dumps((1, "fp1"), pickle.HIGHEST_PROTOCOL),
    ):
        mac = hmac_sha256(key, "dss/planned-load/v2", "t1", "s1", evil).hex()
        assert tag.planned_load({**params, "load_plan": evil, "load_plan_sig": mac}, key) is None
    # A plan with pages on disk (no slot yet) and digested from the store's token array (the
    # same digest as the prompt's list) comes back equal too.
    on_disk = replace(plan, pages=(pages[0], PageSlot(1, PageHash("c" * 32), None, "disk")), is_async=True)
    digested = PlannedLoad("fp1", tokens_digest(np.arange(9, dtype="<i4")), on_disk, 12.5)
    assert digested.prompt == planned.prompt == tokens_digest(list(range(9)))
    assert tokens_digest(tuple(range(9))) == planned.prompt
    with pytest.raises(ValueError):
        tokens_digest([1, 2**31])
    assert tag.planned_load(tag.to_params(key, digested), key) == digested


def test_plans_pickle_as_their_constructor_and_fields() -> None:
    """A load plan crosses the RPC on every load: its pages and slots pickle as constructor calls
    (issue 31: the dataclasses' default state protocol took half a hot load's round trip), and
    come back equal."""
    ref = SlotRef("/dev/shm/dss-1/arena", 4096, 7, 64, 3)
    pages = tuple(PageSlot(i, PageHash(f"{i:032x}"), ref) for i in range(4))
    plan = LoadPlan("L9", 12, 0, pages, False, {"host": 12}, 16)
    for obj in (ref, pages[0], plan, SavePlan("S9", pages)):
        constructor = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[0]
        assert constructor is type(obj)
        assert pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)) == obj
    assert len(pickle.dumps(plan, pickle.HIGHEST_PROTOCOL)) < 600
