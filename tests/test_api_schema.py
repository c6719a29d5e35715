"""schemathesis against the real server's `/openapi.json`: no 5xx, responses match the schema.

Bounded: a few fuzzed cases per operation, as a user key (admin-only operations answer 403), so
the run takes about a minute on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

MAX_EXAMPLES = int(os.environ.get("DSS_SCHEMA_EXAMPLES", "6"))


def test_openapi_schema_fuzzing(api_server: ApiServer, tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    cmd = [
        str(cli), "run", f"{api_server.base_url}/openapi.json",
        "--header", f"Authorization: Bearer {api_server.key('st-fuzz')}",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                    "response_schema_conformance",
        "--phases", "examples,fuzzing",
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "2",
        "--seed", "20250101",
        "--no-shrink",
        "--generation-database", "none",
        "--max-time", "240",
        "--request-timeout", "120",
        "--no-color",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "/v1/chat/completions" in out
