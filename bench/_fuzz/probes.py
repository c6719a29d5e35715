"""The hostile probes (issue 19): NUL characters in ids, prompts and paths, JSON 300 deep, session
ids `.` and `..`, unbounded lists, the erasure of a user whose id has a slash. Each must answer its
documented status, never a 5xx, and the read after it must still answer."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx


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
