"""The local cluster launcher's defaults are "try it" settings (development mode: no API keys;
PostgreSQL and Redis without passwords): it says so when it starts with them, one warning per
insecure default, and says nothing once each is set for production (issue 28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.cluster import parse_args, startup_warnings

REPO = Path(__file__).resolve().parents[2]


def test_the_defaults_warn_once_per_insecure_setting() -> None:
    warnings = startup_warnings(parse_args([]))
    assert len(warnings) == 3, warnings
    dev, db, redis = warnings
    assert "development mode" in dev and "--keys" in dev
    assert "PostgreSQL" in db and "password" in db and "--db-url" in db
    assert "Redis" in redis and "password" in redis and "--redis-url" in redis


def test_production_settings_warn_of_nothing() -> None:
    args = parse_args(
        [
            "--keys",
            "--db-url",
            "postgresql+psycopg://dss:s3cret@db.internal:5432/dss",
            "--redis-url",
            "redis://:s3cret@cache.internal:6379/1",
        ]
    )
    assert startup_warnings(args) == []
    assert startup_warnings(parse_args(["--keys", "--db-url", "postgresql://u:p@h/d", "--no-redis"])) == []


def test_the_launcher_prints_the_warnings_before_it_starts_anything() -> None:
    # --servers 0 is refused before any process starts: the configuration path alone.
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "cluster.py"), "--servers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    out = done.stdout + done.stderr
    assert out.count("warning: insecure default") == 3, out
