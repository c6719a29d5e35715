"""The end users' side of the erasure race (`race.EraseRacer` with an `EndUserProbe`): when the
erased user is an end user of a frontend, before each erasure the probe plants a conversation
with an item for that end user (acknowledged before the erasure is sent), and after the erasure
answered it reads them back: they must be gone (`remnants_visible`). Bystanders hold a
conversation each from the start: the erased end user must never read theirs (`leaks`), and one
that no run can erase (an end user of the same name on another frontend) must keep it (`lost`).
Every count must be 0."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import httpx


def frontend_key(base_url: str, admin_key: str, name: str, timeout: float = 60.0) -> str:
    """A new key of frontend `name` (registered by `POST /v1/admin/keys` if it is not), over REST
    with the admin key; its end users are named by `X-DSS-User` (trusted by default)."""
    r = httpx.post(
        base_url + "/v1/admin/keys",
        json={"frontend": name},
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=timeout,
    )
    if r.status_code not in (200, 201):
        raise RuntimeError(f"POST /v1/admin/keys for frontend {name!r}: {r.status_code} {r.text[:500]}")
    return str(r.json()["key"])


@dataclass
class Bystander:
    """An end user (`key` of its frontend, `end_user`) holding `conversation` all along."""

    key: str
    end_user: str
    must_survive: bool  # False where the fuzzed run may erase it (an end user of the same frontend)
    conversation: str = ""


@dataclass
class Planted:
    conversation: str
    item: str


class EndUserProbe:
    """What an erasure of `end_user` (of the frontend whose key is `key`) must take, and what it
    must leave: see the module docstring."""

    def __init__(
        self, base_url: str, key: str, end_user: str, bystanders: list[Bystander], timeout: float
    ) -> None:
        self.base_url, self.key, self.end_user, self.timeout = base_url, key, end_user, timeout
        self.bystanders = bystanders
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {"remnants_visible": 0, "leaks": 0, "lost": 0, "planted": 0}
        self.findings: list[dict[str, Any]] = []

    def _as(self, key: str, end_user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", "X-DSS-User": end_user}

    def _call(
        self, method: str, path: str, headers: dict[str, str], body: Any = None
    ) -> httpx.Response | None:
        try:
            return httpx.request(
                method, self.base_url + path, json=body, headers=headers, timeout=self.timeout
            )
        except httpx.HTTPError as exc:
            self._found("other", f"{method} {path}", repr(exc))
            return None

    def _found(self, count: str, request: str, answer: str, **info: Any) -> None:
        with self.lock:
            self.counts[count] = self.counts.get(count, 0) + 1
            if len(self.findings) < 20:
                self.findings.append({"finding": count, "request": request, "answer": answer[:500], **info})

    def setup(self) -> None:
        """Each bystander's conversation, made once."""
        for b in self.bystanders:
            item = {"role": "user", "content": f"{b.end_user} keeps this."}
            r = self._call("POST", "/v1/conversations", self._as(b.key, b.end_user), {"items": [item]})
            if r is None or r.status_code != 200:
                raise RuntimeError(
                    f"bystander {b.end_user!r}: {None if r is None else (r.status_code, r.text)}"
                )
            b.conversation = r.json()["id"]

    def plant(self) -> Planted | None:
        """A conversation and an item of the erased end user, acknowledged now (None if refused:
        an erasure by the fuzzed run itself may be running)."""
        me = self._as(self.key, self.end_user)
        r = self._call(
            "POST", "/v1/conversations", me, {"items": [{"role": "user", "content": "Plant one."}]}
        )
        if r is None or r.status_code != 200:
            return None
        cid = r.json()["id"]
        r = self._call(
            "POST", f"/v1/conversations/{cid}/items", me, {"items": [{"role": "user", "content": "Two."}]}
        )
        if r is None or r.status_code != 200:
            return None
        with self.lock:
            self.counts["planted"] += 1
        return Planted(cid, r.json()["data"][0]["id"])

    def check_gone(self, p: Planted, receipt: str | None) -> None:
        """After an erasure answered: the planted conversation and its item read 404 everywhere."""
        me = self._as(self.key, self.end_user)
        for path in (
            f"/v1/conversations/{p.conversation}",
            f"/v1/conversations/{p.conversation}/items",
            f"/v1/conversations/{p.conversation}/items/{p.item}",
        ):
            r = self._call("GET", path, me)
            if r is not None and r.status_code != 404:
                self._found("remnants_visible", f"GET {path}", f"{r.status_code} {r.text}", receipt=receipt)
        r = self._call("GET", "/v1/sessions?limit=100", me)
        if r is not None and r.status_code == 200 and p.conversation in {s["id"] for s in r.json()["data"]}:
            self._found("remnants_visible", "GET /v1/sessions", f"lists {p.conversation}", receipt=receipt)

    def check_bystanders(self) -> None:
        """The erased end user never reads a bystander's conversation; one that must survive does."""
        me = self._as(self.key, self.end_user)
        for b in self.bystanders:
            path = f"/v1/conversations/{b.conversation}"
            r = self._call("GET", path, me)
            if r is not None and r.status_code != 404:
                self._found(
                    "leaks", f"GET {path} as {self.end_user}", f"{r.status_code} {r.text}", owner=b.end_user
                )
            if b.must_survive:
                r = self._call("GET", path, self._as(b.key, b.end_user))
                if r is not None and r.status_code != 200:
                    self._found(
                        "lost", f"GET {path} as its owner", f"{r.status_code} {r.text}", owner=b.end_user
                    )
