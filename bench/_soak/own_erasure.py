"""A soak client and the erasures of its user: erasing itself (`DELETE /v1/users/{me}` with the
admin key, then starting again from nothing with the same session ids), and catching up with every
erasure of its user in the order they were sent (`ErasureLog`): what was acknowledged before one
ended is gone or uncertain; what was sent after it ended must stay; a turn sent before one began
and acknowledged while it ran must not survive it (issue 19, item 4)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .calls import Ambiguous, Erasure
from .model import Entry, same_content
from .server import user_path

if TYPE_CHECKING:
    from .client import Client


class OwnErasure:
    """Erasures of the client's user, its own and the operator's, applied to its ledger."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.ctl, self.rec, self.rng = client.ctl, client.rec, client.rng

    def erase(self) -> None:
        """DELETE /v1/users/{me} with the admin key from this client's own thread (none of its
        requests in flight); the user then starts again from nothing, reusing its session ids."""
        self.c.pending_erase = True
        last = next((e for e in reversed(self.c.ledger.values()) if e.messages is not None), None)
        er = self.ctl.erasures.begin(self.c.user, "self")
        self.c.last_status = None
        gen0 = self.c.gate.gen
        try:
            r = self.c.req("erase", "DELETE", user_path(self.c.user), client=self.c.admin, race_ok=False)
        except Ambiguous:
            answered = self.c.last_status
            # A 4xx erased nothing: void. No answer or a 5xx: it may have erased (a hang may even
            # erase later: unknown). Answered either way, it is a finding already counted, and
            # not retried (a kill's cut erasure is).
            self.ctl.erasures.end(
                er, None, unknown=answered is None, void=answered is not None and answered < 500
            )
            if answered is not None and not (self.c.gate.down or self.c.gate.gen != gen0):
                self.c.pending_erase = False
            raise
        receipt = r.json()
        self.ctl.erasures.end(er, receipt)
        self.c.pending_erase = False
        if not receipt.get("held_nothing"):  # an erasure of nothing writes no receipt
            self.c.receipts.append(receipt["id"])
        self.c.erased_markers += self.c.epoch_markers
        self.c.epoch_markers = []
        self.catch_up()
        self.c.sessions.clear()
        self.c.ledger.clear()
        self.c.responses.clear()
        self.c.pending_delete.clear()
        self.c.epoch += 1
        self.c.next_sid = 0  # the erased session ids are used again
        self.rec.count("erasures")
        left = self.c.req("erase_check", "GET", "/v1/sessions").json()["data"]
        if left and not self.c.raced():
            self.rec.count("leftovers", len(left))
            self.rec.event("sessions_after_erasure", user=self.c.user, sessions=[x["id"] for x in left])
        if last is not None and last.messages is not None:
            # The same prompt again: nothing of the erased user may be cached.
            prompt = last.messages[:-1]
            body = {"model": "default", "messages": prompt, "max_tokens": 1, "temperature": 0}
            usage = self.c.req("erase_check", "POST", "/v1/chat/completions", body).json()["usage"]
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if cached:
                self.rec.count("leftovers")
                self.rec.event("cached_after_erasure", user=self.c.user, cached_tokens=cached)

    def catch_up(self) -> None:
        """Take the finished erasures of this user into account, in the order they were sent:
        what was acknowledged before one ended is gone or uncertain (dropped from the ledger);
        what was sent after it ended must stay. A turn sent before an erasure began and
        acknowledged after it (an overlap) must not survive it (issue 19, item 4): read back."""
        done = self.ctl.erasures.of(self.c.user)
        while self.c.processed < len(done) and done[self.c.processed].e is not None:
            er = done[self.c.processed]
            self.c.processed += 1
            if er.void:
                continue
            end = float(er.e)  # type: ignore[arg-type]
            kept = {k: e for k, e in self.c.ledger.items() if e.q >= end}
            self.rec.count("erased_versions", len(self.c.ledger) - len(kept))
            self.c.ledger = kept
            # Only an erasure that answered its receipt certainly ran (a hung one may not have).
            overlapped = [e for e in self.c.uncertain if e.q < er.s < e.a] if er.receipt else []
            self.c.uncertain = [e for e in self.c.uncertain if e.q >= end]
            live = {e.sid for e in kept.values()}
            for sid in list(self.c.sessions):
                if sid not in live:
                    del self.c.sessions[sid]
                    continue
                s = self.c.sessions[sid]
                mine = {e.number: e for e in kept.values() if e.sid == sid}
                s.known = {n: e.messages for n, e in mine.items() if e.messages is not None}
                s.parents = {n: e.parent for n, e in mine.items()}
                s.dirty = True
            self.c.responses = {rid: r for rid, r in self.c.responses.items() if r.q >= end}
            self.c.pending_delete = {sid for sid in self.c.pending_delete if sid in self.c.sessions}
            for e in overlapped:
                self.check_overlap(e, er)

    def check_overlap(self, e: Entry, er: Erasure) -> None:
        """A version sent before the erasure began and acknowledged while it ran: still there?"""
        with contextlib.suppress(Ambiguous):
            r = self.c.req(
                "overlap_check", "GET", f"/v1/sessions/{e.sid}/versions/{e.number}", expect=(200, 404)
            )
            if r.status_code != 200:
                return
            same = same_content(r.json().get("messages") or [], e)
            if same and self.ctl.erasures.started(self.c.user) == self.c.processed:
                self.rec.count("pre_erasure_kept")
                self.rec.event(
                    "pre_erasure_kept",
                    user=self.c.user,
                    session=e.sid,
                    number=e.number,
                    via=e.via,
                    sent_before_erasure_s=round(er.s - e.q, 3),
                    erasure_receipt=er.receipt,
                )
