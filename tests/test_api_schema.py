"""schemathesis against the real server's `/openapi.json`: no 5xx, responses match the schema.

Bounded: the coverage phase (boundary values) on every operation that does not generate, then a
few fuzzed cases per operation as a user key, then the admin-only operations as an admin key.
About a minute on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

MAX_EXAMPLES = os.environ.get("DSS_SCHEMA_EXAMPLES", "10")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
GENERATING = "create_chat_completion|post_message|create_prefix"
ADMIN_ONLY = "create_prefix|delete_prefix|erase_user|metrics"


def schemathesis(server: ApiServer, key: str, cwd: Path, *args: str) -> str:
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")), "run", f"{server.base_url}/openapi.json",
        "--header", f"Authorization: Bearer {key}",
        "--checks", CHECKS,
        "--workers", "1",  # two workers race inside hypothesis (its lambda-source lookup asserts)
        "--seed", "20250101",
        "--no-shrink",
        "--generation-database", "none",
        "--request-timeout", "120",
        "--no-color",
        *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert " passed" in out
    return out


def test_openapi_schema_coverage_and_fuzzing(api_server: ApiServer, tmp_path: Path) -> None:
    user_key = api_server.key("st-fuzz")
    schemathesis(
        api_server, user_key, tmp_path, "--phases", "coverage", "--exclude-operation-id-regex", GENERATING
    )
    out = schemathesis(api_server, user_key, tmp_path, "--phases", "fuzzing", "--max-examples", MAX_EXAMPLES)
    spec = httpx.get(api_server.base_url + "/openapi.json", timeout=30).json()
    n_operations = sum(len(methods) for methods in spec["paths"].values())
    assert f"{n_operations} passed" in out or f"Tested: {n_operations}" in out, out[-3000:]
    schemathesis(
        api_server,
        api_server.admin_key,
        tmp_path,
        "--phases", "fuzzing",
        "--max-examples", "5",
        "--include-operation-id-regex", ADMIN_ONLY,
    )  # fmt: skip
