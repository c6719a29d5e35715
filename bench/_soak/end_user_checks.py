"""The checks of the soak's end users (`end_users`): after each erasure of an end user, nothing it
held before may be visible through any route; what it holds must stay readable; no end user (nor
a plain user) may see another's. The counts, every one of them must be 0:

- `end_user_remnants`: something of an erased end user (a session, a conversation, an item, a
  response) whose last write ended before its erasure was sent, visible after the erasure
  answered (its own `GET`s, the conversation's items, the response's input items, listed by
  `GET /v1/sessions`), or the end user still listed by the frontend's `GET /v1/users` when it
  wrote nothing since the erasure was sent;
- `end_user_pre_erasure_kept`: the same for a write sent before the erasure was sent and ended
  after it: it either committed before the erasure (and was erased) or was refused
  (`409 user_erased`), never kept under the old epoch;
- `end_user_leaks`: an end user reading another end user's, or a plain soak user's, session,
  conversation, item or response (not 404), or listing it; a plain user reading an end user's;
  the frontend's `GET /v1/users` naming someone not of the frontend;
- `end_user_lost`: something an end user holds (acknowledged, not deleted, no erasure of the end
  user since its write was sent) that does not read back (after each restart, at the end, online).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import TYPE_CHECKING

import httpx

from .calls import Ambiguous, Erasure
from .model import EndUser, Held

if TYPE_CHECKING:
    from .end_users import EndUsers

Viewer = tuple[httpx.Client, dict[str, str] | None]


def routes(h: Held) -> list[str]:
    """The `GET`s that read `h`."""
    q = urllib.parse.quote
    if h.kind == "session":
        return [f"/v1/sessions/{q(h.id)}", f"/v1/sessions/{q(h.id)}/versions"]
    if h.kind == "conversation":
        return [f"/v1/conversations/{h.id}", f"/v1/conversations/{h.id}/items?order=asc"]
    if h.kind == "item":
        return [f"/v1/conversations/{h.conv}/items/{h.id}"]
    return [f"/v1/responses/{h.id}", f"/v1/responses/{h.id}/input_items"]


class EndUserChecks:
    def __init__(self, eu: EndUsers) -> None:
        self.eu, self.ctl, self.rec, self.rng = eu, eu.ctl, eu.rec, eu.rng

    def as_end_user(self, u: EndUser) -> Viewer:
        return self.eu.http, {"X-DSS-User": u.name}

    def readable(self, viewer: Viewer, h: Held, kind: str) -> list[str]:
        """The routes of `h` that answer `viewer` 200 (the others answer 404)."""
        client, headers = viewer
        return [
            path
            for path in routes(h)
            if self.eu.req(kind, "GET", path, expect=(200, 404), client=client, headers=headers).status_code
            == 200
        ]

    def listed(self, viewer: Viewer, kind: str) -> set[str]:
        """The session ids `GET /v1/sessions` lists to `viewer` (conversations are sessions)."""
        client, headers = viewer
        ids: set[str] = set()
        path = "/v1/sessions?limit=100"
        while True:
            page = self.eu.req(kind, "GET", path, client=client, headers=headers).json()
            ids |= {s["id"] for s in page["data"]}
            if not page.get("has_more") or not page["data"]:
                return ids
            path = f"/v1/sessions?limit=100&after={urllib.parse.quote(page['data'][-1]['id'])}"

    def frontend_users(self) -> list[str]:
        """The frontend's end users as `GET /v1/users` lists them (the frontend key: no end user)."""
        out: list[str] = []
        path = "/v1/users?limit=100"
        while True:
            page = self.eu.req("frontend_users", "GET", path).json()
            out += [x["id"] for x in page["data"]]
            if not page.get("has_more") or not page["data"]:
                return out
            path = f"/v1/users?limit=100&after={urllib.parse.quote(out[-1])}"

    # ------------------------------------------------------------------------------ erasures
    def catch_up(self, u: EndUser) -> None:
        """Take the finished erasures of `u` into account, in the order they were sent."""
        done = self.ctl.erasures.of(u.label)
        while u.processed < len(done) and done[u.processed].e is not None:
            er = done[u.processed]
            u.processed += 1
            if not er.void:
                self.after_erasure(u, er)

    def after_erasure(self, u: EndUser, er: Erasure) -> None:
        """Nothing of `u` from before `er` may be visible; `u` starts again from what it wrote
        after `er` answered (nothing: the thread waits for the erasure before going on)."""
        end = float(er.e)  # type: ignore[arg-type]
        before = [h for h in u.held.values() if h.end < er.s]
        raced = [h for h in u.held.values() if h.q < er.s <= h.end]
        u.held = {k: h for k, h in u.held.items() if h.q >= end}
        if er.receipt is None and not er.held_nothing:
            u.markers = [(m, e) for m, e in u.markers if e >= end]
            return  # no answer: it may not have run
        u.erased_markers += [m for m, e in u.markers if e < er.s]  # none may stay in the database
        self.rec.count("end_user_raced_writes", len(raced))  # how often the race was a race
        u.markers = [(m, e) for m, e in u.markers if e >= end]
        self.eu.act_as(u)
        with contextlib.suppress(Ambiguous):
            listed = self.listed(self.as_end_user(u), "frontend_erase_check")
            for group, count in ((before, "end_user_remnants"), (raced, "end_user_pre_erasure_kept")):
                for h in group:
                    seen = self.readable(self.as_end_user(u), h, "frontend_erase_check")
                    seen += ["GET /v1/sessions"] if h.id in listed else []
                    if seen:
                        self.found(count, u, h, er, seen)
            if u.last_write_q < er.s and u.name in self.frontend_users():
                self.rec.count("end_user_remnants")
                self.rec.event("end_user_listed_after_erasure", user=u.label, receipt=er.receipt)

    def found(self, count: str, u: EndUser, h: Held, er: Erasure, seen: list[str]) -> None:
        self.rec.count(count)
        self.rec.event(
            count,
            user=u.label,
            what=h.kind,
            id=h.id,
            conversation=h.conv,
            write_sent_before_erasure_s=round(er.s - h.q, 3),
            write_ended_before_erasure_s=round(er.s - h.end, 3),
            erasure_took_s=round(float(er.e or 0) - er.s, 3),
            receipt=er.receipt,
            held_nothing=er.held_nothing,
            visible_through=seen,
        )

    # ------------------------------------------------------------------------- reads, leaks
    def read_own(self, u: EndUser) -> None:
        """Read back one thing `u` holds (an online check) and list its sessions (no other's)."""
        held = sorted((h for h in u.held.values() if h.acked), key=lambda h: (h.kind, h.id))
        if held:
            self.expect_readable(u, self.rng.choice(held), "online")
        self.listing_leaks(u)

    def expect_readable(self, u: EndUser, h: Held, phase: str) -> None:
        missing = set(routes(h)) - set(self.readable(self.as_end_user(u), h, "frontend_read"))
        if not missing or self.ctl.erasures.erased_since(u.label, h.q):
            return
        u.held.pop((h.kind, h.id), None)
        self.rec.count("end_user_lost")
        self.rec.event(
            "end_user_lost", user=u.label, what=h.kind, id=h.id, phase=phase, missing=sorted(missing)
        )

    def others(self, u: EndUser) -> dict[str, str]:
        """Session ids (conversations included) of the other end users and of the plain users:
        their owner."""
        out = {
            h.id: o.label for o in self.eu.users if o is not u for h in o.held.values() if h.kind != "item"
        }
        for c in self.ctl.clients:
            out.update({sid: c.user for sid in list(c.sessions)})
        return out

    def listing_leaks(self, u: EndUser) -> None:
        theirs = self.others(u)
        for sid in sorted(self.listed(self.as_end_user(u), "frontend_list") & set(theirs)):
            self.leak(u.label, "GET /v1/sessions", sid, theirs[sid])

    def peek(self, u: EndUser) -> None:
        """`u` reads something of another end user's, and of a plain user's; a plain user reads
        something of `u`'s: every one answers 404. Then the frontend's list of end users."""
        mine = sorted(u.held.values(), key=lambda h: (h.kind, h.id))
        theirs = sorted(
            ((o, h) for o in self.eu.users if o is not u for h in o.held.values()),
            key=lambda x: (x[1].kind, x[1].id),
        )
        if theirs:
            o, h = self.rng.choice(theirs)
            for path in self.readable(self.as_end_user(u), h, "frontend_peek"):
                self.leak(u.label, path, h.id, o.label)
        plain = sorted({sid for c in self.ctl.clients for sid in list(c.sessions)})
        if plain:
            sid = self.rng.choice(plain)
            path = f"/v1/sessions/{urllib.parse.quote(sid)}"
            r = self.eu.req("frontend_peek", "GET", path, expect=(200, 404), headers={"X-DSS-User": u.name})
            if r.status_code == 200:
                self.leak(u.label, path, sid, "a plain soak user")
        if mine:
            h = self.rng.choice(mine)
            for path in self.readable((self.eu.replay, None), h, "frontend_peek"):
                self.leak("soak-replay", path, h.id, u.label)
        names = {x.name for x in self.eu.users}
        for other in self.frontend_users():
            if other not in names:
                self.leak("frontend key", "GET /v1/users", other, "not an end user of the frontend")

    def leak(self, viewer: str, route: str, what: str, owner: str) -> None:
        self.rec.count("end_user_leaks")
        self.rec.event("end_user_leak", viewer=viewer, route=route, id=what, owner=owner)

    def gone_after_delete(self, u: EndUser, c: Held) -> None:
        r = self.eu.req(
            "frontend_read",
            "GET",
            f"/v1/conversations/{c.id}",
            expect=(200, 404),
            headers={"X-DSS-User": u.name},
        )
        if r.status_code == 200:
            self.rec.count("unexpected")
            self.rec.event("conversation_after_delete", user=u.label, conversation=c.id)

    # ------------------------------------------------------------------------ the ledger check
    def verify(self, phase: str) -> int:
        """With the traffic paused: everything the end users hold reads back; no listing leaks."""
        checked = 0
        for u in self.eu.users:
            self.eu.act_as(u)
            with contextlib.suppress(Ambiguous):
                for h in sorted((h for h in u.held.values() if h.acked), key=lambda h: (h.kind, h.id)):
                    self.expect_readable(u, h, phase)
                    checked += 1
                self.listing_leaks(u)
        with contextlib.suppress(Ambiguous):
            names = {x.name for x in self.eu.users}
            for other in self.frontend_users():
                if other not in names:
                    self.leak("frontend key", "GET /v1/users", other, "not an end user of the frontend")
        self.rec.count("end_user_verified", checked)
        return checked
