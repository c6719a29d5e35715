"""The soak's checks of what the server acknowledged, run with the traffic paused (after each
restart and at the end): every ledger entry must be listed by `GET /v1/sessions/{sid}/versions`
with its parent and branch, read back by `GET .../versions/{n}` with its messages (a response: its
answer, and `GET /v1/responses/{id}`); every erasure receipt's fresh verification must find no
remnant; erased users' and end users' marker strings must be gone from the SQLite files.

`lost` is the one place a version is declared lost (clients call it too, on an online read):
never when an erasure of its user ran after its request was sent (`ErasureLog.erased_since`),
and each version at most once."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from .calls import Recorder
from .erasures import ErasureLog
from .model import EndUser, Entry, same_content

if TYPE_CHECKING:
    from .client import Client


class Verifier:
    def __init__(self, rec: Recorder, erasures: ErasureLog, data_dir: Path) -> None:
        self.rec, self.erasures, self.data_dir = rec, erasures, data_dir
        self.lost_keys: set[tuple[str, int, int, str]] = set()
        self.lost_lock = threading.Lock()
        self.verified = 0  # ledger entries checked, over every check of the run

    def lost(self, client: Client, e: Entry, why: str, detail: dict[str, Any]) -> None:
        client.ledger.pop((e.sid, e.number), None)
        if self.erasures.erased_since(client.user, e.q):
            self.rec.count("erased_versions")  # its user was erased after it was sent
            return
        key = (client.user, client.epoch, e.number, e.sid)
        with self.lost_lock:
            if key in self.lost_keys:
                return
            self.lost_keys.add(key)
        self.rec.count("lost_versions")
        self.rec.event(
            "lost_version",
            user=client.user,
            session=e.sid,
            number=e.number,
            parent=e.parent,
            branch=e.branch,
            via=e.via,
            why=why,
            expected=e.messages[-2:] if e.messages is not None else e.text,
            **{k: str(v)[:1500] for k, v in detail.items()},
        )

    def _versions(self, client: httpx.Client, sid: str) -> dict[int, Any] | int | None:
        """Every listed version of the session by number, page after page (the listing comes in
        pages of limits.max_list_limit); a page's status when it is not 200; None when a page
        failed (recorded by `_get`)."""
        listed: dict[int, Any] = {}
        after = 0
        while True:
            r = self._get(client, f"/v1/sessions/{sid}/versions?after={after}")
            if r is None or r.status_code != 200:
                return None if r is None else r.status_code
            page = r.json()
            listed.update({v["number"]: v for v in page["data"]})
            if not page["has_more"]:
                return listed
            after = int(page["last_id"])

    def _get(self, client: httpx.Client, path: str) -> httpx.Response | None:
        self.rec.count("requests")
        try:
            r = client.get(path)
        except httpx.HTTPError as exc:
            self.rec.count("unexpected")
            self.rec.event("verify_error", path=path, error=repr(exc))
            return None
        if r.status_code >= 500:
            self.rec.count("errors_5xx")
            self.rec.event("5xx", op="verify", path=path, status=r.status_code, body=r.text[:2000])
            return None
        return r

    def verify_ledgers(self, clients: list[Client], phase: str) -> int:
        """Every acknowledged version must still be listed, with its parent, branch, messages."""
        checked = 0
        for c in clients:
            sids = sorted({sid for sid, _ in c.ledger})
            for sid in sids:
                entries = [e for (s, _), e in c.ledger.items() if s == sid]
                listed = self._versions(c.http, sid)
                if listed is None:
                    continue
                if isinstance(listed, int):
                    what = "session not found" if listed == 404 else f"versions listing {listed}"
                    for e in entries:
                        self.lost(c, e, f"{what} ({phase})", {})
                    continue
                for e in entries:
                    checked += 1
                    v = listed.get(e.number)
                    if v is None:
                        self.lost(c, e, f"not listed ({phase})", {"listed": sorted(listed)})
                        continue
                    if v["parent"] != e.parent or v["branch"] != e.branch:
                        self.lost(c, e, f"other parent/branch ({phase})", {"listed": v})
                        continue
                    d = self._get(c.http, f"/v1/sessions/{sid}/versions/{e.number}")
                    if d is None:
                        continue
                    if d.status_code != 200:
                        self.lost(c, e, f"version read {d.status_code} ({phase})", {"body": d.text})
                    elif not same_content(d.json().get("messages") or [], e):
                        self.lost(c, e, f"other messages ({phase})", {"got": d.json()["messages"][-2:]})
                    elif e.response_id is not None:
                        rr = self._get(c.http, f"/v1/responses/{e.response_id}")
                        if rr is not None and rr.status_code != 200:
                            self.lost(c, e, f"response read {rr.status_code} ({phase})", {"body": rr.text})
        self.verified += checked
        return checked

    def db_scan(self, clients: list[Client]) -> tuple[int, int]:
        """Erased sessions' marker strings in the SQLite files (and, for information, deleted ones')."""
        blobs = b""
        for p in sorted(self.data_dir.glob("dss.sqlite3*")):
            with contextlib.suppress(OSError):
                blobs += p.read_bytes()
        erased = deleted = 0
        for c in clients:
            for mk in c.erased_markers:
                n = blobs.count(mk.encode())
                if n:
                    erased += n
                    self.rec.event("db_marker_after_erasure", user=c.user, marker=mk, hits=n)
            for mk in c.deleted_markers:
                deleted += blobs.count(mk.encode())
        return erased, deleted

    def end_user_db_scan(self, end_users: list[EndUser]) -> int:
        """Erased end users' marker strings in the SQLite files (texts of writes that ended before
        an erasure of theirs was sent)."""
        blobs = b""
        for p in sorted(self.data_dir.glob("dss.sqlite3*")):
            with contextlib.suppress(OSError):
                blobs += p.read_bytes()
        hits = 0
        for u in end_users:
            for mk in u.erased_markers:
                n = blobs.count(mk.encode())
                if n:
                    hits += n
                    self.rec.event("db_marker_after_erasure", user=u.label, marker=mk, hits=n)
        return hits

    def reverify_receipts(self, admin: httpx.Client) -> int:
        """Every receipt's fresh verification (`GET /v1/erasures/{id}`), with the traffic settled:
        the sum of their remnants (a receipt that cannot be read or whose chain is broken: 1)."""
        bad = 0
        for user, rid in self.erasures.all_receipts():
            r = self._get(admin, f"/v1/erasures/{rid}")
            if r is None:
                bad += 1
                continue
            v = r.json().get("verification", {}) if r.status_code == 200 else {}
            if r.status_code != 200 or v.get("remnants") != 0 or not v.get("chain_ok"):
                bad += max(1, int(v.get("remnants") or 0))
                self.rec.event(
                    "receipt_remnants", user=user, receipt=rid, status=r.status_code, body=r.text[:2000]
                )
        return bad
