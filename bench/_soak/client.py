"""A soak client: one user's traffic thread. It keeps that user's ledger (`Client.acked`: every
version the server acknowledged, unless an erasure of the user began since the request was sent)
and picks a weighted random operation each step; the operations live in the parts it is composed
of: `Turns` (chat, `/messages`, dropped streams, the cold replay), `ResponseCalls` (the Responses
API), `SessionCalls` (session routes, reads, hints, deletes, re-reads) and `OwnErasure` (erasing
itself, catching up with erasures of its user).

Each step runs inside the controller's gate (`calls.Gate`): nothing of a client is in flight while
the controller kills the server or checks the ledgers. Parts read and write the client's state
through the client (`self.c`); `ledger`, `responses`, `uncertain` are replaced, never cached."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Any

from .calls import Ambiguous, Caller, Stopped
from .model import ITEMS, MAX_BRANCHES, MAX_DEPTH, MAX_SESSIONS, QUESTIONS, Entry, Messages, Resp, Sess
from .own_erasure import OwnErasure
from .response_calls import ResponseCalls
from .session_calls import SessionCalls
from .turns import Turns

if TYPE_CHECKING:
    from .controller import Controller


class Client(Caller, threading.Thread):
    """One user's traffic: a thread of steps, each a weighted random operation (`OPS`), after
    catching up with erasures of its user, pending deletes and sessions to re-read."""

    def __init__(self, idx: int, user: str, key: str, ctl: Controller, seed: int) -> None:
        threading.Thread.__init__(self, name=f"soak-client-{idx}", daemon=True)
        Caller.__init__(self, ctl)
        self.idx, self.user, self.key = idx, user, key
        self.rng = random.Random(f"{seed}-{idx}")
        self.http = self.http_client(key)
        self.admin = self.http_client(ctl.admin_key)
        self.replay = self.http_client(ctl.replay_key)
        import openai

        self.oa = openai.OpenAI(
            base_url=ctl.server.base_url + "/v1", api_key=key, timeout=ctl.deadline_s, max_retries=0
        )
        self.epoch = 0
        self.next_sid = 0
        self.counter = 0
        self.sessions: dict[str, Sess] = {}
        self.ledger: dict[tuple[str, int], Entry] = {}
        self.responses: dict[str, Resp] = {}
        self.pending_delete: set[str] = set()
        self.pending_erase = False
        self.erased_markers: list[str] = []
        self.deleted_markers: list[str] = []
        self.epoch_markers: list[str] = []
        self.receipts: list[str] = []
        self.processed = 0  # this user's erasures (ErasureLog.of) taken into account
        self.errors_seen = 0
        # Versions acknowledged while an erasure of this user was running: their fate is the
        # erasure's (kept out of the ledger); one sent before it began must not survive it.
        self.uncertain: list[Entry] = []
        self.error: BaseException | None = None
        self.turns = Turns(self)
        self.response_calls = ResponseCalls(self)
        self.session_calls = SessionCalls(self)
        self.own_erasure = OwnErasure(self)

    def run(self) -> None:
        try:
            while not self.gate.stop.is_set():
                with self.gate.step():
                    self.step()
        except Stopped:
            pass
        except BaseException as exc:  # a bug in the soak itself: report it, do not hide it
            import traceback

            self.error = exc
            self.rec.event("client_crash", user=self.user, error=traceback.format_exc())
            self.rec.count("unexpected")

    def seen_erasures(self) -> int:
        return self.processed

    def on_erased_answer(self) -> None:
        for s in self.sessions.values():
            s.dirty = True

    def marker(self) -> str:
        return f"zqk{self.idx}e{self.epoch}x{self.rng.getrandbits(40):010x}"

    def user_text(self, s: Sess | None = None) -> str:
        self.counter += 1
        tag = f"[{s.marker}] " if s is not None else f"[{self.marker()}] "
        return f"{tag}#{self.counter} {self.rng.choice(QUESTIONS)}"

    def new_session(self, stored: bool) -> Sess:
        sid = f"soak-u{self.idx}-s{self.next_sid}"
        self.next_sid += 1
        marker = self.marker()
        self.epoch_markers.append(marker)
        facts = " ".join(
            f"Shelf {k} of room {marker} holds {self.rng.choice(ITEMS)} from {self.rng.randint(1700, 1990)}."
            for k in range(self.rng.randint(12, 30))
        )
        system = f"You are the archivist of room {marker}. Answer briefly. {facts}"
        s = Sess(sid, marker, system, stored)
        self.sessions[sid] = s
        return s

    def acked(
        self,
        s: Sess | None,
        data: dict[str, Any],
        messages: Messages | None,
        via: str,
        expect_parent: int | None,
        q: float,
        text: str | None = None,
        response_id: str | None = None,
    ) -> Entry | None:
        """The server acknowledged a committed version: into the ledger, unless an erasure of
        this user began since the request was sent (its fate is then the erasure's)."""
        number, parent, branch = data.get("state_version"), data.get("parent_version"), data.get("branch")
        sid = s.sid if s is not None else data.get("session_id")
        if not isinstance(number, int) or not isinstance(branch, str) or not isinstance(sid, str):
            self.rec.count("unexpected")
            self.rec.event("ack_without_version", user=self.user, op=via, data=str(data)[:1000])
            if s is not None:
                s.dirty = True
            return None
        self.rec.count("acked_versions")
        e = Entry(sid, number, parent, branch, messages, via, q, time.monotonic(), text, response_id)
        if self.raced():
            self.rec.count("acked_during_erasure")
            self.uncertain.append(e)
            if s is not None:
                s.dirty = True
            return None
        old = self.ledger.get((sid, number))
        if old is not None:  # the number was given out twice: the first version is gone
            self.ctl.verifier.lost(
                self, old, "its number was given to another version", {"new": messages or text}
            )
        if expect_parent is not None and (parent or 0) != expect_parent:
            self.rec.count("other_parent")
        self.ledger[(sid, number)] = e
        if s is not None:
            if messages is not None:
                s.known[number] = messages
            s.parents[number] = parent
            s.branches[branch] = number
            s.vcount = max(s.vcount, number)
        return e

    def step(self) -> None:
        try:
            self.own_erasure.catch_up()
            if self.pending_erase:
                self.own_erasure.erase()
                return
            for sid in list(self.pending_delete):
                self.session_calls.delete(sid)
            for s in [s for s in self.sessions.values() if s.dirty]:
                self.session_calls.resync(s)
            self.random_op()
        except Ambiguous:
            if self.rec.counts["errors_5xx"] > self.errors_seen:  # do not hammer a failing server
                self.errors_seen = self.rec.counts["errors_5xx"]
                time.sleep(2.0)

    def resolve(self) -> None:
        """After a restart and before a check (called by the controller while this client is paused)."""
        for _ in range(3):
            try:
                self.own_erasure.catch_up()
                if self.pending_erase:
                    self.own_erasure.erase()
                for sid in list(self.pending_delete):
                    self.session_calls.delete(sid)
                for s in list(self.sessions.values()):
                    self.session_calls.resync(s)
                return
            except Ambiguous:
                continue

    OPS: tuple[tuple[str, float], ...] = (
        ("chat", 20),
        ("chat_stream", 12),
        ("message", 16),
        ("alternatives", 4),
        ("response", 12),
        ("response_read", 3),
        ("response_delete", 2),
        ("rollback", 7),
        ("branch", 6),
        ("disconnect", 5),
        ("read", 5),
        ("browse", 3),
        ("patch", 2),
        ("warm", 2),
        ("create", 3),
        ("delete", 3),
    )

    def random_op(self) -> None:
        r = self.rng
        ops = [*self.OPS, ("erase", self.ctl.erase_weight)]
        op = r.choices([o for o, _ in ops], [w for _, w in ops])[0]
        self.rec.count(f"op_{op}")
        if op in ("chat", "chat_stream", "message", "disconnect", "alternatives"):
            self.turn(op)
        elif op == "create":
            if len(self.sessions) < MAX_SESSIONS:
                self.session_calls.create()
            else:
                self.turn("chat")
        else:
            sc, rc = self.session_calls, self.response_calls
            {"rollback": sc.rollback, "branch": sc.branch, "read": sc.read, "delete": sc.delete_random,
             "erase": self.own_erasure.erase, "response": rc.respond, "response_read": rc.response_read,
             "response_delete": rc.response_delete, "browse": sc.browse, "patch": sc.patch,
             "warm": sc.warm}[op]()  # fmt: skip

    def pick(self) -> tuple[Sess, str, int] | None:
        options = [
            (s, b, h)
            for s in self.sessions.values()
            for b, h in s.branches.items()
            if (h == 0 or h in s.known) and len(s.base(h)) < MAX_DEPTH
        ]
        if not options:
            return None
        return self.rng.choice(options)

    def turn(self, op: str) -> None:
        picked = self.pick()
        if picked is None or (len(self.sessions) < MAX_SESSIONS and self.rng.random() < 0.12):
            if len(self.sessions) >= MAX_SESSIONS:
                self.session_calls.rollback()
                return
            s = self.new_session(stored=False)
            picked = (s, "main", 0)
        s, branch, head = picked
        if op == "message" and head == 0 and not s.stored_system:
            op = "chat"
        if op == "alternatives" and len(s.branches) >= MAX_BRANCHES - 1:
            op = "chat"
        if op == "chat":
            self.turns.chat(s, head, stream=False)
        elif op == "chat_stream":
            self.turns.chat(s, head, stream=True)
        elif op == "alternatives":
            self.turns.chat(s, head, stream=self.rng.random() < 0.3, n=2)
        elif op == "message":
            self.turns.message(s, branch, head, stream=self.rng.random() < 0.4)
        else:
            self.turns.disconnect(s, branch, head)
