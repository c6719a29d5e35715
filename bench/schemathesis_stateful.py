"""schemathesis with a large budget and stateful links between sessions, versions and branches.

Starts `dss serve` (real engine, default model; short generations: `max_tokens` <= 16) in a fresh
data directory with API keys (one user, one admin), fetches `/openapi.json` and adds OpenAPI
`links` to it - the app's own schema declares none, and this script must not change the app:

- `POST /v1/sessions` -> the session's reads, `/messages`, branches, versions, delete, and a chat
  turn in it (`session_id` put into the generated body);
- a chat turn or a `/messages` turn -> that version (`GET .../versions/{state_version}`), a
  rollback to it, a branch from it, a `/messages` turn on it (`version`), the version list;
- a new branch -> a `/messages` turn on it, a rollback of it, the branch list;
- a rollback -> the session, a `/messages` turn on the branch;
- the session and version lists -> their first entry;
- a session or a turn -> its retention hint (`PATCH`) and a warm-up of it (`version`);
- a response (`POST /v1/responses`) -> `GET` it, its `input_items`, `DELETE` it, a response that
  continues it (`previous_response_id`), its session and its version.

Then runs schemathesis on that schema: the fuzzing phase (`--max-examples` cases per operation)
and the stateful phase (scenarios that follow the links, plus the links schemathesis infers
itself), as the user; then the admin-only operations (and the erasure list and receipts) as the
admin; then the hostile probes (`probes`: a NUL in ids, prompts and paths, metadata 300 deep,
session ids `.` and `..`, 20,000 `stop_token_ids`, 5,000 `bad_words`, the erasure of a user
whose id has a slash): each must answer its documented 4xx (the erasure: 200), never a 5xx, and
the listing read after it must still answer; then the erasure race: fuzzing and stateful again
as a second user whom a thread erases every `--race-erase-every-s` (one time in three twice at
once) with the admin key, checked for no 5xx and documented answers only (an erasure may take a
scenario's session between two steps); every racing erasure must answer a receipt without
remnants, and every receipt is verified again at the end (`remnants`). Checks of the first two
runs: no 5xx, status codes, content types and bodies as documented, the stateful
`use_after_free` (a deleted session must stay gone) and `ensure_resource_availability` (a
created one must be found; as
`session_availability`, which lets the documented 404 of a branch or version that a generated
body names pass), and `acknowledged_version_readable` (the version a turn acknowledged can be read
through the link at once).

Prints schemathesis' summaries, each failure group (request and response, from the JSON report),
each erasure-race finding, and `RESULT cases= ... failures= server_5xx= ... remnants= ...`
(`cases`: test cases generated over the three runs; `failures`: failure groups, probes that
broke their promise, and the race's erasures that answered anything but a receipt or hung);
exits 1 on any failure. `--db-url postgresql+psycopg://...` (an empty database) runs the server
on PostgreSQL.

    .venv/bin/python bench/schemathesis_stateful.py --max-examples 80
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import free_port
from _soak.server import MIB, Server, create_key, try_create_key, use_server_root

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
HOOKS_MODULE = Path(__file__).stem  # schemathesis imports this file for the two custom checks
ADMIN_ONLY = "create_prefix|delete_prefix|erase_user|metrics"
ADMIN_RUN = ADMIN_ONLY + "|list_erasures|get_erasure"  # the last two answer a user 403 / 404
RACE_CHECKS = "not_a_server_error,content_type_conformance,response_schema_conformance"

# (method, path) of the operations the links connect; the operationIds are looked up.
CREATE_SESSION = ("post", "/v1/sessions")
LIST_SESSIONS = ("get", "/v1/sessions")
GET_SESSION = ("get", "/v1/sessions/{session_id}")
DELETE_SESSION = ("delete", "/v1/sessions/{session_id}")
MESSAGES = ("post", "/v1/sessions/{session_id}/messages")
VERSIONS = ("get", "/v1/sessions/{session_id}/versions")
VERSION = ("get", "/v1/sessions/{session_id}/versions/{number}")
ROLLBACK = ("post", "/v1/sessions/{session_id}/rollback")
BRANCHES_POST = ("post", "/v1/sessions/{session_id}/branches")
BRANCHES_GET = ("get", "/v1/sessions/{session_id}/branches")
CHAT = ("post", "/v1/chat/completions")
PATCH_SESSION = ("patch", "/v1/sessions/{session_id}")
WARM = ("post", "/v1/sessions/{session_id}/warm")
RESPONSES = ("post", "/v1/responses")
RESPONSE = ("get", "/v1/responses/{response_id}")
RESPONSE_DELETE = ("delete", "/v1/responses/{response_id}")
RESPONSE_ITEMS = ("get", "/v1/responses/{response_id}/input_items")

SID_BODY = "$response.body#/id"
SID_TURN = "$response.body#/session_id"
SID_REQ = "$request.path.session_id"
NEW_VERSION = "$response.body#/state_version"
FIRST_ID = "$response.body#/data/0/id"
HEAD = "$response.body#/head_version"
RID = "$response.body#/id"


def _links() -> list[tuple[tuple[str, str], str, str, tuple[str, str], dict[str, Any]]]:
    """(source, status, name, target, {parameters?, requestBody?})."""
    turn_links: list[tuple[str, tuple[str, str], dict[str, Any]]] = [
        ("TheVersion", VERSION, {"parameters": {"path.session_id": SID_TURN, "path.number": NEW_VERSION}}),
        ("TheVersions", VERSIONS, {"parameters": {"path.session_id": SID_TURN}}),
        (
            "RollbackToIt",
            ROLLBACK,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"to_version": NEW_VERSION}},
        ),
        (
            "BranchFromIt",
            BRANCHES_POST,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"from_version": NEW_VERSION}},
        ),
        (
            "ContinueIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"version": NEW_VERSION}},
        ),
        ("TheSession", GET_SESSION, {"parameters": {"path.session_id": SID_TURN}}),
        (
            "WarmIt",
            WARM,
            {"parameters": {"path.session_id": SID_TURN}, "requestBody": {"version": NEW_VERSION}},
        ),
        ("HintIt", PATCH_SESSION, {"parameters": {"path.session_id": SID_TURN}}),
    ]
    rid = {"parameters": {"path.response_id": RID}}
    r_sid = "$response.body#/dss/session_id"
    out: list[tuple[tuple[str, str], str, str, tuple[str, str], dict[str, Any]]] = []
    for src in (CHAT, MESSAGES):
        out += [(src, "200", name, dst, spec) for name, dst, spec in turn_links]
    sid = {"parameters": {"path.session_id": SID_BODY}}
    out += [
        (CREATE_SESSION, "201", "GetIt", GET_SESSION, sid),
        (CREATE_SESSION, "201", "ItsVersions", VERSIONS, sid),
        (CREATE_SESSION, "201", "ItsBranches", BRANCHES_GET, sid),
        (CREATE_SESSION, "201", "FirstMessage", MESSAGES, sid),
        (CREATE_SESSION, "201", "DeleteIt", DELETE_SESSION, sid),
        (CREATE_SESSION, "201", "ChatInIt", CHAT, {"requestBody": {"session_id": SID_BODY}}),
        (CREATE_SESSION, "201", "HintIt", PATCH_SESSION, sid),
        (CREATE_SESSION, "201", "WarmIt", WARM, sid),
        (PATCH_SESSION, "200", "TheSession", GET_SESSION, sid),
        (PATCH_SESSION, "200", "WarmIt", WARM, sid),
        (RESPONSES, "200", "GetIt", RESPONSE, rid),
        (RESPONSES, "200", "ItsInputItems", RESPONSE_ITEMS, rid),
        (RESPONSES, "200", "DeleteIt", RESPONSE_DELETE, rid),
        (RESPONSES, "200", "ContinueIt", RESPONSES, {"requestBody": {"previous_response_id": RID}}),
        (RESPONSES, "200", "ItsSession", GET_SESSION, {"parameters": {"path.session_id": r_sid}}),
        (
            RESPONSES,
            "200",
            "ItsVersion",
            VERSION,
            {"parameters": {"path.session_id": r_sid, "path.number": "$response.body#/dss/version"}},
        ),
        (RESPONSE, "200", "ContinueIt", RESPONSES, {"requestBody": {"previous_response_id": RID}}),
        (RESPONSE, "200", "DeleteIt", RESPONSE_DELETE, rid),
        (GET_SESSION, "200", "ItsVersions", VERSIONS, sid),
        (GET_SESSION, "200", "ItsBranches", BRANCHES_GET, sid),
        (GET_SESSION, "200", "DeleteIt", DELETE_SESSION, sid),
        (LIST_SESSIONS, "200", "FirstSession", GET_SESSION, {"parameters": {"path.session_id": FIRST_ID}}),
        (
            VERSIONS,
            "200",
            "FirstVersion",
            VERSION,
            {"parameters": {"path.session_id": SID_REQ, "path.number": "$response.body#/data/0/number"}},
        ),
        (
            BRANCHES_POST,
            "201",
            "MessageOnIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_REQ}, "requestBody": {"branch": "$response.body#/name"}},
        ),
        (
            BRANCHES_POST,
            "201",
            "RollItBack",
            ROLLBACK,
            {
                "parameters": {"path.session_id": SID_REQ},
                "requestBody": {"branch": "$response.body#/name", "to_version": HEAD},
            },
        ),
        (BRANCHES_POST, "201", "TheBranches", BRANCHES_GET, {"parameters": {"path.session_id": SID_REQ}}),
        (ROLLBACK, "200", "TheSession", GET_SESSION, {"parameters": {"path.session_id": SID_REQ}}),
        (
            ROLLBACK,
            "200",
            "MessageOnIt",
            MESSAGES,
            {"parameters": {"path.session_id": SID_REQ}, "requestBody": {"branch": "$response.body#/name"}},
        ),
    ]  # fmt: skip
    return out


def add_links(schema: dict[str, Any]) -> int:
    """Add the links to a fetched schema (in place); returns how many were added."""
    paths = schema["paths"]
    ids = {
        (m, p): op["operationId"] for p, ops in paths.items() for m, op in ops.items() if "operationId" in op
    }
    added = 0
    for src, status, name, dst, spec in _links():
        if src not in ids or dst not in ids:
            print(f"warning: no operation {src if src not in ids else dst}; link {name} skipped", flush=True)
            continue
        response = paths[src[1]][src[0]].setdefault("responses", {}).setdefault(status, {"description": ""})
        response.setdefault("links", {})[name] = {"operationId": ids[dst], **spec}
        added += 1
    return added


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
    here = str(Path(__file__).resolve().parent)
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


def _error_code(response: Any) -> str | None:
    with contextlib.suppress(Exception):
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
            return str(code) if code is not None else None
    return None


def _register_checks() -> None:
    """The custom checks, registered when schemathesis imports this file (SCHEMATHESIS_HOOKS)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import ensure_resource_availability

    @schemathesis.check
    def session_availability(ctx: Any, response: Any, case: Any) -> bool | None:
        """schemathesis' `ensure_resource_availability` (a session just created must be found),
        except for the documented 404 of a *branch* or *version* that a generated body names
        inside an existing session (`branch_not_found`, `version_not_found`): the session is there."""
        if response.status_code != 404 or _error_code(response) in ("branch_not_found", "version_not_found"):
            return None
        result: bool | None = ensure_resource_availability(ctx, response, case)
        return result

    @schemathesis.check
    def acknowledged_version_readable(ctx: Any, response: Any, case: Any) -> bool | None:
        """A turn the server acknowledged (200 with `state_version`) must be readable right after
        through the link to `GET /v1/sessions/{sid}/versions/{state_version}`; a stored response
        (200 from `POST /v1/responses` without `store: false`) through `GET /v1/responses/{id}`."""
        if response.status_code != 404 or case.operation.path not in (VERSION[1], RESPONSE[1]):
            return None
        if case.operation.path == RESPONSE[1]:
            return _stored_response_readable(ctx, response, case)
        internals = getattr(ctx, "internals", None)
        if internals is None:
            return None
        parent = internals.find_parent(case_id=case.id)
        parent_response = internals.find_response(case_id=parent.id) if parent is not None else None
        if parent_response is None or parent_response.status_code != 200:
            return None
        with contextlib.suppress(Exception):
            body = parent_response.json()
            params = case.path_parameters or {}
            if (
                isinstance(body, dict)
                and body.get("session_id") == params.get("session_id")
                and body.get("state_version") == params.get("number")
            ):
                raise AssertionError(
                    f"{parent.operation.label} acknowledged version {body['state_version']} of session "
                    f"{body['session_id']!r}, but reading it answers 404: {response.text[:300]}"
                )
        return None


def _stored_response_readable(ctx: Any, response: Any, case: Any) -> None:
    internals = getattr(ctx, "internals", None)
    if internals is None:
        return
    parent = internals.find_parent(case_id=case.id)
    parent_response = internals.find_response(case_id=parent.id) if parent is not None else None
    if parent is None or parent_response is None or parent_response.status_code != 200:
        return
    if parent.operation.path != RESPONSES[1]:
        return
    body: Any = None
    with contextlib.suppress(ValueError):
        body = parent_response.json()
    sent = parent.body if isinstance(parent.body, dict) else {}
    asked = (case.path_parameters or {}).get("response_id")
    if isinstance(body, dict) and sent.get("store", True) is not False and body.get("id") == asked:
        raise AssertionError(
            f"response {asked!r} was stored, but reading it answers 404: {response.text[:300]}"
        )


if os.environ.get("SCHEMATHESIS_HOOKS") == HOOKS_MODULE:
    _register_checks()


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


@dataclass
class Probe:
    """One hostile request: it must never answer 5xx, and must answer one of `expect` (issue 19:
    NUL characters, deep JSON, `.` session ids, unbounded lists, ids with a slash)."""

    name: str
    method: str
    path: str
    body: Any = None
    expect: tuple[int, ...] = (400, 404, 422)
    admin: bool = False
    then: tuple[str, str] | None = None  # (method, path) that must not answer 5xx afterwards


def _deep(n: int) -> Any:
    out: Any = "leaf"
    for _ in range(n):
        out = {"k": out}
    return out


def probes(odd_user: str | None) -> list[Probe]:
    nul = "\x00"
    hi = [{"role": "user", "content": "Hi"}]
    out = [
        Probe("nul in a session id (body)", "POST", "/v1/sessions", {"session_id": f"p{nul}x"}),
        Probe(
            "nul in a system prompt",
            "POST",
            "/v1/sessions",
            {"session_id": "probe-nul", "system_prompt": f"a{nul}b"},
            then=("GET", "/v1/sessions"),
        ),
        Probe("nul in a session id (path)", "GET", "/v1/sessions/%00"),
        Probe(
            "nul in a message", "POST", "/v1/sessions/%00/messages", {"content": f"a{nul}b", "max_tokens": 1}
        ),
        Probe("nul user erased", "DELETE", "/v1/users/%00", admin=True),
        Probe(
            "metadata 300 deep",
            "POST",
            "/v1/sessions",
            {"session_id": "probe-deep", "metadata": _deep(300)},
            expect=(400, 413, 422),
            then=("GET", "/v1/sessions"),
        ),
        Probe("session id '.'", "POST", "/v1/sessions", {"session_id": "."}, expect=(400, 422)),
        Probe("session id '..'", "POST", "/v1/sessions", {"session_id": ".."}, expect=(400, 422)),
        Probe(
            "20,000 stop_token_ids",
            "POST",
            "/v1/chat/completions",
            {"messages": hi, "max_tokens": 1, "stop_token_ids": list(range(20000))},
            expect=(400, 413, 422),
        ),
        Probe(
            "5,000 bad_words",
            "POST",
            "/v1/chat/completions",
            {"messages": hi, "max_tokens": 1, "bad_words": [f"w{i}" for i in range(5000)]},
            expect=(400, 413, 422),
        ),
    ]
    if odd_user is not None:
        path = "/v1/users/" + urllib.parse.quote(odd_user, safe="")
        out.append(Probe(f"erase {odd_user!r}", "DELETE", path, admin=True, expect=(200,)))
    return out


def run_probes(base_url: str, user_key: str, admin_key: str, odd_user: str | None) -> list[dict[str, Any]]:
    """Each probe once; the findings (request and answer) of those that broke their promise."""
    findings: list[dict[str, Any]] = []
    for p in probes(odd_user):
        key = admin_key if p.admin else user_key
        headers = {"Authorization": f"Bearer {key}"}
        request = f"{p.method} {p.path}"
        try:
            r = httpx.request(p.method, base_url + p.path, json=p.body, headers=headers, timeout=120)
        except httpx.HTTPError as exc:
            findings.append({"probe": p.name, "request": request, "answer": repr(exc)})
            continue
        if r.status_code >= 500 or r.status_code not in p.expect:
            findings.append(
                {"probe": p.name, "request": request, "status": r.status_code, "answer": r.text[:400]}
            )
        if p.then is not None:
            after = httpx.request(p.then[0], base_url + p.then[1], headers=headers, timeout=60)
            if after.status_code >= 500:
                findings.append({"probe": p.name + ", read after", "request": " ".join(p.then),
                                 "status": after.status_code, "answer": after.text[:400]})  # fmt: skip
    return findings


class EraseRacer(threading.Thread):
    """Erases one user every `period` s (one time in three twice at once) with the admin key while
    schemathesis runs as that user: every answer must be a receipt (200) whose verification holds
    no remnant; the receipts are verified again once the run is over (`remnants`)."""

    def __init__(self, base_url: str, admin_key: str, user: str, period: float, deadline: float) -> None:
        super().__init__(name="erase-racer", daemon=True)
        self.base_url, self.user, self.period = base_url, user, period
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.deadline = deadline
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.receipts: list[str] = []
        self.counts: dict[str, int] = {"erasures": 0, "errors_5xx": 0, "hangs": 0, "other": 0}
        self.remnants_at_erasure = 0
        self.findings: list[dict[str, Any]] = []

    def _count(self, key: str, finding: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if finding is not None and len(self.findings) < 20:
                self.findings.append(finding)

    def erase(self) -> None:
        path = f"/v1/users/{self.user}"
        t0 = time.monotonic()
        try:
            r = httpx.delete(self.base_url + path, headers=self.headers, timeout=self.deadline)
        except httpx.TimeoutException:
            self._count("hangs", {"request": f"DELETE {path}", "answer": f"none in {self.deadline:.0f} s"})
            return
        except httpx.HTTPError as exc:
            self._count("other", {"request": f"DELETE {path}", "answer": repr(exc)})
            return
        if r.status_code != 200:
            key = "errors_5xx" if r.status_code >= 500 else "other"
            self._count(key, {"request": f"DELETE {path}", "status": r.status_code, "answer": r.text[:1000]})
            return
        receipt = r.json()
        ver = receipt.get("verification") or {}
        bad = int(ver.get("remnants") or 0) + (0 if ver.get("chain_ok") else 1)
        with self.lock:
            self.counts["erasures"] += 1
            self.receipts.append(receipt["id"])
            self.remnants_at_erasure += bad
            if bad and len(self.findings) < 20:
                self.findings.append({"request": f"DELETE {path}", "took_s": round(time.monotonic() - t0, 2),
                                      "verification": ver})  # fmt: skip

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.wait(self.period * rng.uniform(0.5, 1.5)):
            k = 2 if rng.random() < 1 / 3 else 1
            threads = [threading.Thread(target=self.erase, daemon=True) for _ in range(k)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(self.deadline + 5)

    def reverify(self) -> int:
        """The fresh verification of every receipt: the sum of their remnants."""
        bad = 0
        for rid in self.receipts:
            try:
                r = httpx.get(
                    f"{self.base_url}/v1/erasures/{rid}", headers=self.headers, timeout=self.deadline
                )
            except httpx.HTTPError as exc:
                bad += 1
                self.findings.append({"request": f"GET /v1/erasures/{rid}", "answer": repr(exc)})
                continue
            ver = r.json().get("verification") or {} if r.status_code == 200 else {}
            if r.status_code != 200 or ver.get("remnants") != 0 or not ver.get("chain_ok"):
                bad += max(1, int(ver.get("remnants") or 0))
                self.findings.append({"request": f"GET /v1/erasures/{rid}", "status": r.status_code,
                                      "answer": r.text[:1000]})  # fmt: skip
        return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--max-examples", type=int, default=80, help="fuzzing cases per operation")
    p.add_argument("--timeout-s", type=float, default=1500, help="kill the user run after this long")
    p.add_argument("--max-steps", type=int, default=10, help="steps per stateful scenario")
    p.add_argument("--admin-examples", type=int, default=20)
    p.add_argument("--seed", type=int, default=20250101)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--server-root", type=Path, default=None, help="run this copy of the code")
    p.add_argument(
        "--db-url",
        default=None,
        help="an empty database for the server (e.g. postgresql+psycopg://...; default: SQLite)",
    )
    p.add_argument("--race-examples", type=int, default=20, help="cases per operation of the erasure race")
    p.add_argument(
        "--race-timeout-s", type=float, default=600, help="kill the erasure race run after this long"
    )
    p.add_argument("--race-erase-every-s", type=float, default=3.0, help="mean period of the racing erasures")
    args = p.parse_args(argv)
    if args.server_root is not None:
        use_server_root(args.server_root)
    out = args.out or Path(tempfile.mkdtemp(prefix="dss-schemathesis-"))
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "data"
    if data_dir.exists() and any(data_dir.iterdir()):
        raise SystemExit(f"{data_dir} is not empty")
    data_dir.mkdir(parents=True, exist_ok=True)
    admin_key = create_key(data_dir, None, args.db_url)
    user_key = create_key(data_dir, "st-fuzz", args.db_url)
    race_user = "st-race"
    race_key = create_key(data_dir, race_user, args.db_url)
    odd_user = "probe@org/user"  # issue 19, item 1: erasable if `dss keys create` accepts it
    odd = try_create_key(data_dir, odd_user, args.db_url) is not None
    probe_findings: list[dict[str, Any]] = []
    racer: EraseRacer | None = None
    remnants = 0
    server = FuzzServer(data_dir, args.port or free_port(), out / "server.log", admin_key)
    server.db_url = args.db_url
    t0 = time.monotonic()
    try:
        server.start()
        print(f"server ready in {time.monotonic() - t0:.0f} s ({server.base_url})", flush=True)
        schema = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
        n_links = add_links(schema)
        schema_path = out / "openapi-with-links.json"
        schema_path.write_text(json.dumps(schema, indent=1))
        print(f"{n_links} links added -> {schema_path}", flush=True)
        (out / "schemathesis.toml").write_text(f"[phases.stateful]\nmax-steps = {args.max_steps}\n")
        runs = [
            (
                "user: fuzzing + stateful",
                user_key,
                [
                    "--phases", "fuzzing,stateful",
                    "--max-examples", str(args.max_examples),
                    "--seed", str(args.seed),
                    "--exclude-operation-id-regex", ADMIN_ONLY,
                ],
                args.timeout_s,
            ),
            (
                "admin: admin-only operations",
                admin_key,
                [
                    "--phases", "fuzzing",
                    "--max-examples", str(args.admin_examples),
                    "--seed", str(args.seed),
                    "--include-operation-id-regex", ADMIN_RUN,
                ],
                600,
            ),
            (
                "race: fuzzing + stateful as a user erased all along",
                race_key,
                [
                    "--phases", "fuzzing,stateful",
                    "--max-examples", str(args.race_examples),
                    "--seed", str(args.seed + 1),
                    "--exclude-operation-id-regex", ADMIN_ONLY,
                ],
                args.race_timeout_s,
            ),
        ]  # fmt: skip
        totals: dict[str, int] = {}
        rcs: list[int] = []
        failures: list[dict[str, Any]] = []
        for i, (title, key, extra, timeout) in enumerate(runs):
            report = out / f"report-{i}.json"
            t1 = time.monotonic()
            if key == race_key and args.race_erase_every_s > 0:
                racer = EraseRacer(server.base_url, admin_key, race_user, args.race_erase_every_s, 120.0)
                racer.start()
            # A user erased all along loses sessions between a scenario's steps: only the
            # checks that hold whatever an erasure took (no 5xx, answers as documented).
            checks = RACE_CHECKS if key == race_key else CHECKS
            rc, text = run_schemathesis(
                schema_path, server.base_url, key, out, report, *extra, timeout=timeout, checks=checks
            )
            if i == 1:  # after the admin run: the hostile probes, then the race
                probe_findings = run_probes(server.base_url, user_key, admin_key, odd_user if odd else None)
                print(f"=== hostile probes: {len(probes(odd_user if odd else None))} sent, "
                      f"{len(probe_findings)} broke their promise", flush=True)  # fmt: skip
            if racer is not None and racer.is_alive():
                racer.stop.set()
                racer.join(150)
                remnants = racer.reverify()
            (out / f"schemathesis-{i}.log").write_text(text)
            counts, groups = report_counts(report, text)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            rcs.append(rc)
            failures += groups
            tail = text[text.find("SUMMARY") :] if "SUMMARY" in text else text[-6000:]
            print(
                f"=== {title}: rc={rc} in {time.monotonic() - t1:.0f} s; {counts}\n{tail[-12000:]}",
                flush=True,
            )
        metrics = server.scrape() or {}
    finally:
        if racer is not None:
            racer.stop.set()
        server.stop()
    log = (out / "server.log").read_text(errors="replace") if (out / "server.log").exists() else ""
    tracebacks = log.count("Traceback (most recent call last)")
    if tracebacks:
        first = log.index("Traceback (most recent call last)")
        print("--- first server traceback:\n" + log[first : first + 4000], flush=True)
    result = {
        "cases": totals.get("generated", 0),
        "with_failures": totals.get("with_failures", 0),
        "unique_failures": totals.get("unique_failures", 0),
        "errored": totals.get("errored", 0),
        "scenarios": totals.get("scenarios", 0),
        "links_covered": totals.get("links_covered", 0),
        "links_selected": totals.get("links_selected", 0),
        "links_added": n_links,
        "probes": len(probes(odd_user if odd else None)),
        "probe_failures": len(probe_findings),
        "failures": len(failures)
        + len(probe_findings)
        + (sum(racer.counts[k] for k in ("errors_5xx", "hangs", "other")) if racer else 0),
        "server_5xx": int(metrics.get("server_5xx", 0)),
        "race_erasures": racer.counts["erasures"] if racer else 0,
        "race_erasure_5xx": racer.counts["errors_5xx"] if racer else 0,
        "race_erasure_hangs": racer.counts["hangs"] if racer else 0,
        "race_erasure_other": racer.counts["other"] if racer else 0,
        "remnants_at_erasure": racer.remnants_at_erasure if racer else 0,
        "remnants": remnants,
        "server_tracebacks": tracebacks,
        "rcs": "/".join(map(str, rcs)),
    }
    for g in failures:
        print(f"failure group: {json.dumps(g, default=str)}", flush=True)
    race_findings = racer.findings if racer is not None else []
    for f in race_findings:
        print(f"erasure race: {json.dumps(f, default=str)}", flush=True)
    for f in probe_findings:
        print(f"probe: {json.dumps(f, default=str)}", flush=True)
    (out / "result.json").write_text(
        json.dumps(
            {"result": result, "failures": failures[:50], "race": race_findings, "probes": probe_findings},
            indent=1,
            default=str,
        )
    )
    print(f"out: {out}", flush=True)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    ok = all(rc == 0 for rc in rcs) and not failures and result["server_5xx"] == 0
    ok = ok and not (result["failures"] or result["remnants"] or result["remnants_at_erasure"])
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    os._exit(130)
