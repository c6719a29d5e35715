"""What the cluster's servers share, made ready before they start: the PostgreSQL database (created
when missing), Redis (checked: without it the servers serve from their local tiers), the one master
key (0600 in the work directory), and free ports on loopback."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from deploy.spec import LOOPBACK, ClusterError


def ensure_database(db_url: str) -> None:
    """Create the PostgreSQL database of `db_url` when it does not exist (the servers create the
    schema themselves: migrations run at start-up, under an advisory lock). Other URLs: nothing."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    url = make_url(db_url)
    if not url.drivername.startswith("postgresql") or not url.database:
        return
    admin = create_engine(
        url.set(database="postgres"), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database}
            ).first()
            if exists is None:
                name = url.database.replace('"', '""')
                conn.execute(text(f'CREATE DATABASE "{name}"'))
                print(f"created the database {url.database}", flush=True)
    except OperationalError as exc:
        shown = url.render_as_string(hide_password=True)
        raise ClusterError(
            f"PostgreSQL does not answer at {shown} ({exc.orig}); start one (.ci/run shows how) "
            "or pass --db-url"
        ) from None
    finally:
        admin.dispose()


def check_redis(redis_url: str) -> str | None:
    """Why Redis does not answer at `redis_url` (a warning: the servers then serve from their local
    tiers only), or None when it answers PING."""
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        return str(exc)
    return None


def master_key(work_dir: Path) -> str:
    """The cluster's one master key (64 hex characters, `dss.keys.crypto`'s format), kept in
    `<work_dir>/master.key` with mode 0600 and created on first use. Every server must have the
    same one: a page written by one is read by another."""
    path = work_dir / "master.key"
    work_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    mode = path.stat().st_mode & 0o777
    if mode != 0o600:
        raise ClusterError(f"{path} has mode {mode:04o}; it must be 0600 (chmod 600 {path})")
    return path.read_text().strip()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True
