"""What every part of the local cluster launcher shares: the servers' specs (a name, a fixed place
on HAProxy's hash ring, a port, a data directory), the loopback address everything binds to, the
default shared database and Redis, and `ClusterError` (a start that cannot happen, with what to
do about it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
DEFAULT_DB_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/dss_cluster"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/1"


class ClusterError(Exception):
    """The cluster cannot start; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One `dss serve` of the cluster. `number` is its fixed place on HAProxy's hash ring."""

    name: str
    number: int
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def server_specs(count: int, first_port: int, work_dir: Path) -> list[ServerSpec]:
    """Servers a, b, c, ... on consecutive ports, each with `<work_dir>/<name>/` as data directory."""
    if not 1 <= count <= 26:
        raise ClusterError(f"--servers must be between 1 and 26, not {count}")
    names = [chr(ord("a") + i) for i in range(count)]
    return [ServerSpec(n, i + 1, first_port + i, work_dir / n) for i, n in enumerate(names)]
