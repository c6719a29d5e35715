"""One schemathesis run as a subprocess (its checks, the hooks module, a JSON report) and what its
report counts; the fuzzed server's settings (`FuzzServer`: short generations, small tiers)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from _soak.server import MIB, Server

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "use_after_free",
        "session_availability",  # ensure_resource_availability, minus documented 404s (below)
        "acknowledged_version_readable",
    ]
)
HOOKS_MODULE = "_fuzz.hooks"  # schemathesis imports it (bench/ on PYTHONPATH) for the two custom checks
ADMIN_ONLY = "create_prefix|delete_prefix|erase_user|metrics"
ADMIN_RUN = ADMIN_ONLY + "|list_erasures|get_erasure"  # the last two answer a user 403 / 404
# A frontend key fuzzed as one of its end users: its erasures of end users and their list are in.
FRONTEND_EXCLUDED = "create_prefix|delete_prefix|metrics"
RACE_CHECKS = "not_a_server_error,content_type_conformance,response_schema_conformance"


def run_schemathesis(
    schema_path: Path,
    base_url: str,
    key: str,
    cwd: Path,
    report: Path,
    *args: str,
    timeout: float,
    checks: str = CHECKS,
) -> tuple[int, str]:
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")), "run", str(schema_path),
        "--url", base_url,
        "--header", f"Authorization: Bearer {key}",
        "--checks", checks,
        "--workers", "1",  # two workers race inside hypothesis (its lambda-source lookup asserts)
        "--no-shrink",
        "--generation-database", "none",
        "--request-timeout", "120",
        "--no-color",
        "--report", "json",
        "--report-json-path", str(report),
        *args,
    ]  # fmt: skip
    print("$ " + " ".join(c if "Bearer" not in c else "Authorization: Bearer ***" for c in cmd), flush=True)
    here = str(Path(__file__).resolve().parents[1])  # bench/, where `_fuzz.hooks` is found
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS_MODULE}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
        )
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        return 124, out + f"\n(schemathesis ran past {timeout:.0f} s)"


def report_counts(report: Path, out: str) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Test-case counts and failure groups of a run (its JSON report), and the links it covered."""
    counts: dict[str, int] = {}
    groups: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, json.JSONDecodeError):
        data = json.loads(report.read_text())
        counts = {k: int(v) for k, v in (data.get("test_cases") or {}).items()}
        groups = list(data.get("failures") or []) + [{"error": e} for e in data.get("errors") or []]
    m = re.search(r"API Links:\s*(\d+) covered / (\d+) selected", out)
    if m:
        counts["links_covered"], counts["links_selected"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"Scenarios:\s*(\d+)", out)
    if m:
        counts["scenarios"] = int(m.group(1))
    return counts, groups


class FuzzServer(Server):
    db_url: str | None = None  # default: SQLite in the data directory

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.db_url:
            env["DSS_STORE__DB_URL"] = self.db_url
        env.update(
            {
                # A fuzzer's max_tokens must not keep the CPU engine busy for minutes.
                "DSS_LIMITS__MAX_OUTPUT_TOKENS": "16",
                "DSS_LIMITS__DEFAULT_MAX_TOKENS": "4",
                "DSS_STORE__HOST_CAPACITY_BYTES": str(256 * MIB),
                "DSS_STORE__DISK_CAPACITY_BYTES": str(2 << 30),
                "DSS_STORE__FSYNC": "false",
            }
        )
        return env
