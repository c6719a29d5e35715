"""schemathesis against the real server's `/openapi.json`: no 5xx, responses match the schema.

Bounded: the coverage phase (boundary values) on every operation that does not generate, then a
few fuzzed cases per operation as a user key, then the admin-only operations as an admin key.
About a minute on two cores. Then the stateful phase with erasures racing it (below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api_server import ApiServer, api_server
from tests.paths import REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]


MAX_EXAMPLES = os.environ.get("DSS_SCHEMA_EXAMPLES", "10")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
GENERATING = "create_chat_completion|post_message|create_prefix"
ADMIN_ONLY = (
    "create_prefix|delete_prefix|erase_user|metrics|list_users"
    "|post_key|list_keys|revoke_key|post_frontend|list_frontends|patch_frontend|list_audit"
)
# Fuzzed as admin: all but `revoke_key`. Schemathesis feeds ids from `list_keys` answers into the
# revoke, so it revoked the shared server's admin key and every later module got 401s;
# tests/api/keys/test_frontends.py covers the revoke (and its 404s) instead.
ADMIN_FUZZED = ADMIN_ONLY.replace("|revoke_key", "")


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
        "--include-operation-id-regex", ADMIN_FUZZED,
    )  # fmt: skip
    # The server is shared with later modules: its admin key must have come through the fuzzing.
    admin = {"Authorization": f"Bearer {api_server.admin_key}"}
    r = httpx.get(api_server.base_url + "/v1/admin/keys", headers=admin, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("who", ["user", "end user"])
def test_openapi_stateful_with_erasures_racing(api_server: ApiServer, tmp_path: Path, who: str) -> None:
    """The stateful phase over the links of `bench/schemathesis_stateful.py` (`bench/_fuzz/`:
    sessions, turns, versions, branches, responses, hints, warm-ups, conversations and their
    items, a frontend's end users) as a user whom a thread erases every couple of seconds (with
    the admin key), or as an end user of a frontend key (`X-DSS-User`) whom a thread erases
    through the frontend key, planting a conversation before each erasure: no 5xx and documented
    answers only, whatever the erasures take between two steps; every racing erasure answers a
    receipt without remnants, and so does each one re-read at the end; an erased end user's
    conversation is gone after its erasure, it never reads a bystander's, and an end user of the
    same name on another frontend keeps hers. Bounded: a few scenarios of a few steps (about
    half a minute each on two cores)."""
    sys.path.insert(0, str(REPO / "bench"))
    from _fuzz.end_users import Bystander, EndUserProbe, frontend_key
    from _fuzz.links import add_links
    from _fuzz.race import EraseRacer
    from _fuzz.runs import FRONTEND_EXCLUDED, RACE_CHECKS, run_schemathesis

    base, admin_key = api_server.base_url, api_server.admin_key
    probe: EndUserProbe | None = None
    examples = "3" if who == "user" else "12"  # the end user's scenarios end sooner (~3 s for 12)
    if who == "user":
        user = "st-race"
        key, extra = api_server.key(user), ["--exclude-operation-id-regex", ADMIN_ONLY]
        racer = EraseRacer(base, admin_key, user, period=2.0, deadline=120.0)
    else:
        user = "st-fe-race"
        key, key_b = frontend_key(base, admin_key, "st-fe"), frontend_key(base, admin_key, "st-fe-b")
        extra = ["--header", f"X-DSS-User: {user}", "--exclude-operation-id-regex", FRONTEND_EXCLUDED]
        bystanders = [Bystander(key, "st-fe-bystander", False), Bystander(key_b, user, True)]
        probe = EndUserProbe(base, key, user, bystanders, 120.0)
        # Every second: the per-end-user limit on erasure checks (a burst of 5) holds for a run this short.
        racer = EraseRacer(base, admin_key, user, period=1.0, deadline=120.0, erase_key=key, probe=probe)
    schema = httpx.get(base + "/openapi.json", timeout=30).json()
    assert add_links(schema) >= 55
    schema_path = tmp_path / "openapi-with-links.json"
    schema_path.write_text(json.dumps(schema))
    (tmp_path / "schemathesis.toml").write_text("[phases.stateful]\nmax-steps = 4\n")
    racer.start()
    try:
        rc, out = run_schemathesis(
            schema_path,
            base,
            key,
            tmp_path,
            tmp_path / "report.json",
            "--phases", "stateful",
            "--max-examples", os.environ.get("DSS_SCHEMA_RACE_EXAMPLES", examples),
            "--seed", "20250102",
            *extra,
            timeout=400,
            checks=RACE_CHECKS,
        )  # fmt: skip
    finally:
        racer.stop.set()
        racer.join(150)
    remnants = racer.reverify()
    findings = racer.findings + (probe.findings if probe is not None else [])
    print(*[ln for ln in out.splitlines() if "API Links" in ln or "Scenarios" in ln], sep="\n")
    print(
        f"{who}: erasures {racer.counts}, remnants_at_erasure={racer.remnants_at_erasure} remnants={remnants}"
    )
    assert rc == 0, out[-8000:]
    assert racer.counts["erasures"] >= 1, (racer.counts, findings, out[-3000:])
    assert {k: racer.counts[k] for k in ("errors_5xx", "hangs", "other")} == dict.fromkeys(
        ("errors_5xx", "hangs", "other"), 0
    ), findings
    assert (racer.remnants_at_erasure, remnants) == (0, 0), findings
    if probe is not None:
        print(f"end user: {probe.counts}")
        zero = ("remnants_visible", "leaks", "lost", "other")
        assert {k: probe.counts.get(k, 0) for k in zero} == dict.fromkeys(zero, 0), findings
        assert probe.counts["planted"] >= 1, (probe.counts, findings)
