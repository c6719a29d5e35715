"""Soak and fault campaign: the real `dss serve` under mixed traffic on every route, with erasures
racing it, SIGKILLed and restarted.

What it does (docs/operations.md, "Soak and fault campaign", says how to read the result):

- creates API keys (`dss keys create`) for one user per client (client 1's id is
  `soak@org/user-1` unless `--no-odd-user-id` or `dss keys create` refuses it: every id the
  server accepts must be erasable), one admin and one replay user in a fresh data directory,
  then starts `dss serve` as a subprocess in its own process group, with small tiers (host arena
  64 MiB, disk 256 MiB, vLLM KV cache 1 GiB) so that eviction runs;
- runs `--clients` threads for `--duration-s` seconds of traffic (time spent restarting does not
  count), each as its own user, mixing every route a user has, generations kept short (4-16
  tokens): chat turns with `session_id` through the official `openai` client (streamed and not,
  greedy), `n` = 2 alternatives (sibling versions), stateful `/messages` turns (streamed and not),
  the Responses API (`POST /v1/responses`, streamed and not, chains through
  `previous_response_id`, forks at older responses, `store: false`; `GET` a response and its
  `input_items`; `DELETE`, with `cascade=true` for one that others continue), explicit session
  creation, rollbacks, branches (`POST`, `GET`), session reads and lists, `PATCH` retention hints,
  warm-ups, session deletes, `GET /v1/models` and `/v1/prefixes`, the client erasing its own user
  with the admin key (it then goes on with fresh sessions, reusing the erased ids), and streams
  the client drops after two chunks;
- an operator thread races the clients: every `--race-erase-every-s` (+-50 %) it erases one of
  the clients' users while that user's traffic runs (`DELETE /v1/users/{id}`; one time in three
  two or three at once; some with the user's own key, the others with the admin key), and now
  and then lists receipts (`GET /v1/erasures`), re-reads one (`GET /v1/erasures/{id}`), creates,
  lists and deletes public prefixes, reads `/healthz`, `/readyz`, `/v1/models` and the console;
- every `--kill-every-s` seconds of traffic (+-20 %) sends SIGKILL to the whole process group (the
  API process and the engine's children), restarts the server on the same data directory and
  waits for `/readyz`;
- keeps a client-side ledger of every version the server acknowledged (session, number, parent,
  branch, the messages as sent plus the answer as returned; for a response, its answer and id),
  minus what the client itself deleted or erased. After each restart and at the end, with the
  traffic paused, every ledger entry is checked through `GET /v1/sessions/{sid}/versions`, `GET
  .../versions/{n}` (and `GET /v1/responses/{id}`).

Every request has a client deadline (`--deadline-s`). The counts of the last line:

- `requests`: HTTP requests sent (traffic, checks and the operator's, `/metrics` scrapes aside).
- `hangs`: requests that passed their deadline (no answer, or an answer that came late), and
  pauses whose requests in flight never finished.
- `errors_5xx`: answers with a 5xx status the soak got (`server_5xx` in the DETAIL line: what the
  server counted, also for clients gone; `/readyz` while starting aside).
- `lost_versions`: versions acknowledged (200 with `state_version`) that are not readable later -
  not listed, listed with another parent or branch, other messages, or (a response) `GET
  /v1/responses/{id}` not 200 - unless an erasure of their user ran after their request was sent
  (such an erasure may have taken them: `erased_versions`). A version acknowledged while an
  erasure of its user ran is never in the ledger (`acked_during_erasure`).
- `corrupt_served`: answers that differ from a cold recompute beyond rounding, plus pages that
  failed their checksum or authentication on their way to the engine (`dss_corrupt_pages_total`
  from `/metrics`, summed over the server's lives; scraped every 5 s and before each kill). The
  cold recompute: a `--replay-fraction` of non-streamed greedy session turns is replayed by
  another user (its own cache namespace) as a plain request with the same messages; where the
  texts differ (`greedy_mismatch`: a few percent on this CPU bf16 build whatever the cache did,
  batch composition moves the rounding), the first differing token is judged from the
  log-probabilities: a cold run that preferred its own token by more than `CORRUPT_MARGIN` nats
  over the one served is not rounding (`corrupt_answers`). Turns whose prompt differs in length
  from the replay's (stored ids that do not tokenize back) are left out (`greedy_prompt_differs`).
- `remnants`: the sum of the verification remnants of every erasure's receipt, read again with
  `GET /v1/erasures/{id}` after the traffic settled (a receipt that cannot be read, or whose
  chain is broken, counts 1).
- `restarts`: kills survived.

The DETAIL line before it adds, among others: `unexpected` (a connection error no kill explains,
an answer a valid request should not get, a crash of the soak itself), `remnants_at_erasure` (the
verification each DELETE answered with), `pre_erasure_kept` (a turn sent before an erasure of its
user began, acknowledged while it ran, and still readable after it: issue 19, item 4),
`leftovers` (after a client's own erasure: sessions still listed, cached tokens for a replay of
its prompt, its marker strings in `dss.sqlite3*`), `erased_4xx` / `erased_aborted` (requests of a
user whose erasure raced them answered 404, 409 or 410, or ended by an `error` event: the
erasure won, as it may; never counted as errors), `interrupted` (requests cut by a kill: their
outcome is unknown, the client re-reads and never adds an unacknowledged version).

The exit status is 1 when any of hangs, errors_5xx, lost_versions, corrupt_served, remnants,
unexpected, remnants_at_erasure, pre_erasure_kept, leftovers or restart_failures is not 0.
`--out` keeps summary.json, events.jsonl (every finding with its request and answer) and
server.log.

    .venv/bin/python bench/soak.py --duration-s 1200 --kill-every-s 180 --clients 4 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _soak_server
from _procs import free_port
from _soak_calls import Ambiguous, Caller, Erasure, Gate, Recorder, Stopped, first_divergence, sse
from _soak_server import MIB, Server, create_key, try_create_key, user_path

__all__ = ["MIB", "Server", "create_key", "free_port"]  # what bench/schemathesis_stateful.py uses

MAX_SESSIONS = 3  # per client
MAX_DEPTH = 13  # messages in a version before a client stops extending it
MAX_BRANCHES = 6  # per session
FAIL_KEYS = (
    "hangs",
    "errors_5xx",
    "lost_versions",
    "corrupt_served",
    "remnants",
    "unexpected",
    "restart_failures",
    "remnants_at_erasure",
    "pre_erasure_kept",
    "leftovers",
)
# Nats by which a cold recompute may prefer its token over the one served at the first point
# where they differ, before the difference is not rounding any more (bf16 on CPU moves a
# 135M model's logits by a few tenths at most between batch compositions).
CORRUPT_MARGIN = 1.5
ODD_USER = "soak@org/user-1"  # client 1's user id with --odd-user-id

QUESTIONS = [
    "Which shelf holds the oldest item?",
    "Name one item from the list.",
    "What is on shelf 3?",
    "Summarise the room in five words.",
    "Which year appears most often?",
    "Is there anything made of brass?",
    "What should a visitor see first?",
    "Answer with one word: big or small?",
    "Count the shelves you know about.",
    "Which item would you lend out?",
    "Repeat the session code.",
    "What did I ask before?",
]
ITEMS = [
    "a brass compass", "an oak chest", "a glass lantern", "a silver spoon", "a wool blanket",
    "a copper kettle", "a paper map", "a tin soldier", "a clay pot", "a leather boot",
    "an iron key", "a linen shirt", "a bone comb", "a stone axe", "a cork float",
]  # fmt: skip


# ----------------------------------------------------------------------------------- clients
Messages = list[dict[str, Any]]


@dataclass
class Sess:
    sid: str
    marker: str
    system: str
    stored_system: bool  # created by POST /v1/sessions with the system prompt
    branches: dict[str, int] = field(default_factory=lambda: {"main": 0})
    known: dict[int, Messages] = field(default_factory=dict)  # acknowledged or read back
    parents: dict[int, int | None] = field(default_factory=dict)
    vcount: int = 0
    dirty: bool = False  # its state is uncertain: re-read it before the next step
    n_branches: int = 0

    def root(self) -> Messages:
        return [{"role": "system", "content": self.system}]

    def base(self, head: int) -> Messages:
        return self.root() if head == 0 else self.known[head]


@dataclass
class Entry:
    """An acknowledged version. `messages` is what the version must list; a Responses version
    (`response_id`) is checked by its last message (`text`) and by `GET /v1/responses/{id}`."""

    sid: str
    number: int
    parent: int | None
    branch: str
    messages: Messages | None
    via: str
    q: float = 0.0  # when its request was sent
    a: float = 0.0  # when its acknowledgement arrived
    text: str | None = None
    response_id: str | None = None


@dataclass
class Resp:
    """A stored response of this client (a version of its `resp-…` session)."""

    id: str
    sid: str
    version: int
    q: float
    children: int = 0


class Client(Caller, threading.Thread):
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
        self.processed = 0  # this user's erasures (Controller.erasures_of) taken into account
        self.errors_seen = 0
        # Versions acknowledged while an erasure of this user was running: their fate is the
        # erasure's (kept out of the ledger); one sent before it began must not survive it.
        self.uncertain: list[Entry] = []
        self.error: BaseException | None = None

    # ----------------------------------------------------------------------------- plumbing
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

    def catch_up(self) -> None:
        """Take the finished erasures of this user into account, in the order they were sent:
        what was acknowledged before one ended is gone or uncertain (dropped from the ledger);
        what was sent after it ended must stay. A turn sent before an erasure began and
        acknowledged after it (an overlap) must not survive it (issue 19, item 4): read back."""
        done = self.ctl.erasures_of(self.user)
        while self.processed < len(done) and done[self.processed].e is not None:
            er = done[self.processed]
            self.processed += 1
            if er.void:
                continue
            end = float(er.e)  # type: ignore[arg-type]
            kept = {k: e for k, e in self.ledger.items() if e.q >= end}
            self.rec.count("erased_versions", len(self.ledger) - len(kept))
            self.ledger = kept
            # Only an erasure that answered its receipt certainly ran (a hung one may not have).
            overlapped = [e for e in self.uncertain if e.q < er.s < e.a] if er.receipt else []
            self.uncertain = [e for e in self.uncertain if e.q >= end]
            live = {e.sid for e in kept.values()}
            for sid in list(self.sessions):
                if sid not in live:
                    del self.sessions[sid]
                    continue
                s = self.sessions[sid]
                mine = {e.number: e for e in kept.values() if e.sid == sid}
                s.known = {n: e.messages for n, e in mine.items() if e.messages is not None}
                s.parents = {n: e.parent for n, e in mine.items()}
                s.dirty = True
            self.responses = {rid: r for rid, r in self.responses.items() if r.q >= end}
            self.pending_delete = {sid for sid in self.pending_delete if sid in self.sessions}
            for e in overlapped:
                self.check_overlap(e, er)

    def check_overlap(self, e: Entry, er: Erasure) -> None:
        """A version sent before the erasure began and acknowledged while it ran: still there?"""
        with contextlib.suppress(Ambiguous):
            r = self.req(
                "overlap_check", "GET", f"/v1/sessions/{e.sid}/versions/{e.number}", expect=(200, 404)
            )
            if r.status_code != 200:
                return
            got = r.json().get("messages") or []
            same = (
                got == e.messages
                if e.messages is not None
                else bool(got) and got[-1].get("content") == e.text
            )
            if same and self.ctl.erasures_started(self.user) == self.processed:
                self.rec.count("pre_erasure_kept")
                self.rec.event(
                    "pre_erasure_kept",
                    user=self.user,
                    session=e.sid,
                    number=e.number,
                    via=e.via,
                    sent_before_erasure_s=round(er.s - e.q, 3),
                    erasure_receipt=er.receipt,
                )

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
            self.ctl.lost(self, old, "its number was given to another version", {"new": messages or text})
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

    # ---------------------------------------------------------------------------- the steps
    def step(self) -> None:
        try:
            self.catch_up()
            if self.pending_erase:
                self.erase()
                return
            for sid in list(self.pending_delete):
                self.delete(sid)
            for s in [s for s in self.sessions.values() if s.dirty]:
                self.resync(s)
            self.random_op()
        except Ambiguous:
            if self.rec.counts["errors_5xx"] > self.errors_seen:  # do not hammer a failing server
                self.errors_seen = self.rec.counts["errors_5xx"]
                time.sleep(2.0)

    def resolve(self) -> None:
        """After a restart and before a check (called by the controller while this client is paused)."""
        for _ in range(3):
            try:
                self.catch_up()
                if self.pending_erase:
                    self.erase()
                for sid in list(self.pending_delete):
                    self.delete(sid)
                for s in list(self.sessions.values()):
                    self.resync(s)
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
                self.create()
            else:
                self.turn("chat")
        else:
            {"rollback": self.rollback, "branch": self.branch, "read": self.read,
             "delete": self.delete_random, "erase": self.erase, "response": self.respond,
             "response_read": self.response_read, "response_delete": self.response_delete,
             "browse": self.browse, "patch": self.patch, "warm": self.warm}[op]()  # fmt: skip

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
                self.rollback()
                return
            s = self.new_session(stored=False)
            picked = (s, "main", 0)
        s, branch, head = picked
        if op == "message" and head == 0 and not s.stored_system:
            op = "chat"
        if op == "alternatives" and len(s.branches) >= MAX_BRANCHES - 1:
            op = "chat"
        if op == "chat":
            self.chat(s, head, stream=False)
        elif op == "chat_stream":
            self.chat(s, head, stream=True)
        elif op == "alternatives":
            self.chat(s, head, stream=self.rng.random() < 0.3, n=2)
        elif op == "message":
            self.message(s, branch, head, stream=self.rng.random() < 0.4)
        else:
            self.disconnect(s, branch, head)

    def chat(self, s: Sess, head: int, stream: bool, n: int = 1) -> None:
        sent = [*s.base(head), {"role": "user", "content": self.user_text(s)}]
        max_tokens = self.rng.choice([6, 8, 12, 16])
        kind = ("chat_stream" if stream else "chat") + ("_n" if n > 1 else "")
        # n > 1 samples (siblings would be identical greedily); a single answer is greedy and,
        # not streamed, carries log-probs for the cold recompute (`greedy_replay`).
        if n > 1 and self.ctl.alt_seed:
            extra_seed: dict[str, Any] = {"seed": self.counter}
        else:
            extra_seed = {}
        sampling: dict[str, Any] = extra_seed | ({"temperature": 0} if n == 1 else {"temperature": 1.0})
        s.dirty = True  # until acknowledged
        if not stream:
            resp = self.openai_call(
                kind,
                lambda: self.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    n=n,
                    logprobs=n == 1,
                    top_logprobs=5 if n == 1 else None,
                    extra_body={"session_id": s.sid},
                    **sampling,
                ),
            )
            q = self.last_q
            data = dict(resp.model_extra or {})
            choices = [(c.message.content or "", dict(c.model_extra or {}), c.logprobs) for c in resp.choices]
            usage = resp.usage.prompt_tokens if resp.usage is not None else None
        else:

            def consume() -> tuple[dict[int, str], dict[int, dict[str, Any]], dict[str, Any]]:
                parts: dict[int, list[str]] = {}
                per_choice: dict[int, dict[str, Any]] = {}
                fields: dict[str, Any] = {}
                for chunk in self.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    n=n,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"session_id": s.sid},
                    **sampling,
                ):
                    extra = chunk.model_extra or {}
                    if extra.get("state_version") is not None:
                        fields = dict(extra)
                    for ch in chunk.choices:
                        if ch.delta.content:
                            parts.setdefault(ch.index, []).append(ch.delta.content)
                        if (ch.model_extra or {}).get("state_version") is not None:
                            per_choice[ch.index] = dict(ch.model_extra or {})
                return {i: "".join(p) for i, p in parts.items()}, per_choice, fields

            texts, per_choice, data = self.openai_call(kind, consume)
            q = self.last_q
            choices = [(texts.get(i, ""), per_choice.get(i, {}), None) for i in range(n)]
            usage = None
        for i, (text, extra, _) in enumerate(choices):
            messages = [*sent, {"role": "assistant", "content": text}]
            if extra.get("state_version") is not None:
                self.acked(s, {**data, **extra}, messages, kind, head, q)
            elif i == 0:
                self.acked(s, data, messages, kind, head, q)
            else:  # an alternative without its own version: the docs promise one
                self.rec.count("unexpected")
                self.rec.event("alternative_without_version", user=self.user, index=i, data=str(data)[:500])
        if not self.raced():
            s.dirty = False
        if not stream and n == 1 and self.rng.random() < self.ctl.replay_fraction:
            self.greedy_replay(sent, max_tokens, choices[0][0], data, choices[0][2], usage)

    def greedy_replay(
        self,
        sent: Messages,
        max_tokens: int,
        text: str,
        data: dict[str, Any],
        logprobs: Any,
        prompt_tokens: int | None,
    ) -> None:
        """The same messages as a plain request of another user (its own namespace: a cold
        prefill), greedy: the same text? Where not, the first differing token decides: a cold run
        that preferred its token by more than `CORRUPT_MARGIN` nats over the one served is not
        rounding (batch composition moves logits by far less): `corrupt_answers`."""
        body = {
            "model": "default",
            "messages": sent,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
        }
        r = self.req("replay", "POST", "/v1/chat/completions", body, client=self.replay).json()
        choice = r["choices"][0]
        other = choice["message"]["content"]
        dss = data.get("dss") or {}
        loaded = int(dss.get("loaded_tokens") or 0)  # read from a DSS tier by the connector
        cached = int(dss.get("cached_tokens") or 0)  # not computed: DSS or vLLM's own prefix cache
        self.rec.count("greedy_checked")
        self.rec.count("greedy_checked_cached", 1 if cached else 0)
        self.rec.count("greedy_checked_loaded", 1 if loaded else 0)
        if other == text:
            return
        self.rec.count("greedy_mismatch")
        self.rec.count("greedy_mismatch_cached", 1 if cached else 0)
        self.rec.count("greedy_mismatch_loaded", 1 if loaded else 0)
        ours = [t.model_dump() for t in (logprobs.content or [])] if logprobs is not None else []
        cold = list((choice.get("logprobs") or {}).get("content") or [])
        cold_prompt = int((r.get("usage") or {}).get("prompt_tokens") or 0)
        if prompt_tokens is not None and cold_prompt != prompt_tokens:
            # The session's prompt is its stored ids: where they do not tokenize back from the
            # text, the two prompts differ and so may the answers.
            self.rec.count("greedy_prompt_differs")
            return
        div = first_divergence(ours, cold)
        where = {"session": text, "cold": other, "dss": dss}
        if div is None:
            self.rec.event("greedy_mismatch", keep=10, **where, note="no token-level divergence")
            return
        pos, cold_margin, our_margin = div
        if cold_margin > CORRUPT_MARGIN:
            self.rec.count("corrupt_answers")
            self.rec.event(
                "corrupt_answer",
                user=self.user,
                position=pos,
                cold_margin=cold_margin,
                served_margin=our_margin,
                messages=sent[-2:],
                **where,
            )
        else:
            self.rec.event(
                "greedy_mismatch", keep=10, position=pos, cold_margin=round(cold_margin, 3), **where
            )

    def message(self, s: Sess, branch: str, head: int, stream: bool) -> None:
        content = self.user_text(s)
        body = {
            "content": content,
            "branch": branch,
            "max_tokens": self.rng.choice([6, 8, 12]),
            "temperature": 0,
            "stream": stream,
        }
        path = f"/v1/sessions/{s.sid}/messages"
        s.dirty = True
        if not stream:
            data = self.req("message", "POST", path, body).json()
            text = data["choices"][0]["message"]["content"]
        else:
            text, data = self.stream_request(
                "message_stream", path, body, lambda ev: ev.get("state_version") is not None
            )
        q, raced = self.last_q, self.raced()
        parent = data.get("parent_version")
        if not raced and parent is not None and parent not in s.known:
            self.resync(s)  # the client did not know that version: read it back
        base = s.root() if parent is None else s.known.get(parent)
        if base is None:
            if not raced:
                self.rec.count("unexpected")
                self.rec.event("unknown_parent", user=self.user, session=s.sid, data=str(data)[:500])
            return
        if data.get("branch") != branch:
            self.rec.count("unexpected")
            self.rec.event("message_wrong_branch", user=self.user, asked=branch, got=data.get("branch"))
        messages = [*base, {"role": "user", "content": content}, {"role": "assistant", "content": text}]
        self.acked(s, data, messages, "message_stream" if stream else "message", head, q)
        s.dirty = raced

    # ---------------------------------------------------------------------- the Responses API
    def respond(self) -> None:
        """POST /v1/responses: a new chain, its continuation, or a fork at an older response;
        streamed or not; now and then `store: false` (nothing may be kept)."""
        r = self.rng
        prev = r.choice(sorted(self.responses.values(), key=lambda x: x.id)) if self.responses else None
        if prev is not None and (r.random() < 0.25 or prev.version >= MAX_DEPTH // 2):
            prev = None
        store = r.random() > 0.1
        stream = r.random() < 0.35
        text_in = self.user_text()
        body: dict[str, Any] = {
            "model": "default",
            "input": text_in,
            "instructions": "Answer in a few words.",
            "max_output_tokens": r.choice([4, 6, 8]),
            "temperature": 0,
            "store": store,
        }
        if prev is not None:
            body["previous_response_id"] = prev.id
        if stream:
            body["stream"] = True
            out_text, ev = self.stream_request(
                "response_stream", "/v1/responses", body, lambda e: e.get("type") == "response.completed"
            )
            data = ev.get("response") or {}
        else:
            data = self.req("response", "POST", "/v1/responses", body).json()
            out_text = data.get("output_text") or "".join(
                p.get("text", "") for o in data.get("output") or [] for p in o.get("content") or []
            )
        q = self.last_q
        dss = data.get("dss") or {}
        rid = data.get("id")
        if not store:
            self.rec.count("responses_unstored")
            if isinstance(rid, str):  # nothing kept: not even the record
                with contextlib.suppress(Ambiguous):
                    self.req("response_read", "GET", f"/v1/responses/{rid}", expect=(404,))
            return
        if not isinstance(rid, str) or not isinstance(dss.get("session_id"), str):
            self.rec.count("unexpected")
            self.rec.event("response_without_record", user=self.user, data=str(data)[:1000])
            return
        fields = {
            "state_version": dss.get("version"),
            "branch": dss.get("branch"),
            "session_id": dss.get("session_id"),
            "parent_version": prev.version if prev is not None and prev.sid == dss["session_id"] else None,
        }
        via = "response_stream" if stream else "response"
        entry = self.acked(None, fields, None, via, None, q, text=out_text, response_id=rid)
        if entry is not None:
            self.responses[rid] = Resp(rid, entry.sid, entry.number, q)
            if prev is not None and prev.id in self.responses:
                self.responses[prev.id].children += 1
            self.rec.count("responses_stored")

    def response_read(self) -> None:
        if not self.responses:
            return
        resp = self.rng.choice(sorted(self.responses.values(), key=lambda x: x.id))
        r = self.req("response_read", "GET", f"/v1/responses/{resp.id}")
        if r.json().get("id") != resp.id:
            self.rec.count("unexpected")
            self.rec.event("response_read_other", user=self.user, asked=resp.id, got=r.text[:500])
        order = self.rng.choice(["asc", "desc"])
        items = self.req(
            "response_items", "GET", f"/v1/responses/{resp.id}/input_items?order={order}&limit=5"
        )
        if not isinstance(items.json().get("data"), list):
            self.rec.count("unexpected")

    def response_delete(self) -> None:
        """DELETE a leaf response (200), or an inner one with `cascade=true`."""
        if not self.responses:
            return
        resp = self.rng.choice(sorted(self.responses.values(), key=lambda x: x.id))
        cascade = resp.children > 0
        path = f"/v1/responses/{resp.id}" + ("?cascade=true" if cascade else "")
        body = self.req("response_delete", "DELETE", path).json()
        gone = set(body.get("deleted_response_ids") or []) | {resp.id}
        for rid in gone:
            old = self.responses.pop(rid, None)
            if old is not None:
                self.ledger.pop((old.sid, old.version), None)
        for sid, n in [k for k, e in self.ledger.items() if e.response_id in gone]:
            del self.ledger[(sid, n)]
        self.rec.count("response_deletes")

    # ------------------------------------------------------------------- reads, hints, warm-ups
    def browse(self) -> None:
        """The listing routes: sessions, one session, its branches, models, public prefixes."""
        listed = self.req("browse", "GET", "/v1/sessions?limit=50").json()
        if not isinstance(listed.get("data"), list):
            self.rec.count("unexpected")
        if self.sessions:
            s = self.rng.choice(sorted(self.sessions.values(), key=lambda x: x.sid))
            self.req("browse", "GET", f"/v1/sessions/{s.sid}/branches")
        self.req("browse", "GET", "/v1/models")
        self.req("browse", "GET", "/v1/prefixes")

    def patch(self) -> None:
        if not self.sessions:
            return
        s = self.rng.choice(sorted(self.sessions.values(), key=lambda x: x.sid))
        body: dict[str, Any] = {
            "kv_retention": self.rng.choice(["normal", "evict", "pinned", "normal"]),
            "kv_idle_ttl_s": self.rng.choice([None, 5, 600]),
        }
        # A pinned session beyond the pinned cap is a documented 409.
        r = self.req("patch", "PATCH", f"/v1/sessions/{s.sid}", body, expect=(200, 409))
        if r.status_code == 409 and "pinned_cap_exceeded" not in r.text:
            self._status("patch", r.status_code, r.text, (200,))

    def warm(self) -> None:
        options = [(s, b) for s in self.sessions.values() for b in s.branches]
        if not options:
            return
        s, b = self.rng.choice(sorted(options, key=lambda x: (x[0].sid, x[1])))
        self.req("warm", "POST", f"/v1/sessions/{s.sid}/warm", {"branch": b}, expect=(202,))

    def disconnect(self, s: Sess, branch: str, head: int) -> None:
        """A stream the client drops after two content chunks: nothing should be committed."""
        before = s.vcount
        if head > 0 and self.rng.random() < 0.5:
            path = f"/v1/sessions/{s.sid}/messages"
            body: dict[str, Any] = {"content": self.user_text(s), "branch": branch, "stream": True}
        else:
            path = "/v1/chat/completions"
            sent = [*s.base(head), {"role": "user", "content": self.user_text(s)}]
            body = {"messages": sent, "session_id": s.sid, "stream": True}
        body.update({"max_tokens": 96, "temperature": 0})
        gen0, t0 = self._begin()
        s.dirty = True
        chunks = 0
        try:
            with self.http_client(self.key) as c, c.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._status("disconnect", resp.status_code, resp.text, (200,))
                for ev in sse(resp):
                    if isinstance(ev, dict) and any(
                        (ch.get("delta") or {}).get("content") for ch in ev.get("choices") or []
                    ):
                        chunks += 1
                    if chunks >= 2 or ev == "[DONE]" or (isinstance(ev, dict) and "error" in ev):
                        break
        except httpx.TimeoutException as exc:
            raise self._outcome("disconnect", gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self._outcome("disconnect", gen0, t0, exc, timeout=False) from None
        self.rec.count("disconnects")
        time.sleep(0.3)
        self.resync(s, ghost_from=before)

    def create(self) -> None:
        s = self.new_session(stored=True)
        s.dirty = True
        self.req("create", "POST", "/v1/sessions", {"session_id": s.sid, "system_prompt": s.system}, (201,))
        s.dirty = self.raced()

    def rollback(self) -> None:
        options = [(s, b, h) for s in self.sessions.values() for b, h in s.branches.items() if h > 0]
        if not options:
            return
        s, branch, head = self.rng.choice(options)
        chain, v = [], head
        while v is not None and v in s.parents:
            chain.append(v)
            v = s.parents[v]
        if not chain:
            return
        to = self.rng.choice(chain)
        s.dirty = True
        r = self.req(
            "rollback",
            "POST",
            f"/v1/sessions/{s.sid}/rollback",
            {"to_version": to, "branch": branch, "expected_head": head},
        )
        if r.json().get("head_version") != to:
            self.rec.count("unexpected")
            self.rec.event("rollback_wrong_head", user=self.user, asked=to, got=r.json())
        s.branches[branch] = to
        s.dirty = self.raced()
        self.rec.count("rollbacks")

    def branch(self) -> None:
        options = [(s, n) for s in self.sessions.values() for n in s.known if len(s.branches) < MAX_BRANCHES]
        if not options:
            return
        s, n = self.rng.choice(options)
        s.n_branches += 1
        name = f"alt-{s.n_branches}"
        s.dirty = True
        self.req(
            "branch", "POST", f"/v1/sessions/{s.sid}/branches", {"from_version": n, "name": name}, (201,)
        )
        s.branches[name] = n
        s.dirty = self.raced()
        self.rec.count("branches")

    def read(self) -> None:
        """List a session's versions: every acknowledged one must be there (an online check)."""
        sids = sorted({sid for sid, _ in self.ledger})
        if not sids:
            return
        sid = self.rng.choice(sids)
        listed: set[int] = set()
        after = 0
        while True:  # the listing comes in pages of limits.max_list_limit
            page = self.req("read", "GET", f"/v1/sessions/{sid}/versions?after={after}").json()
            listed |= {v["number"] for v in page["data"]}
            if not page["has_more"]:
                break
            after = int(page["last_id"])
        for (lsid, n), e in list(self.ledger.items()):
            if lsid == sid and n not in listed:
                self.ctl.lost(self, e, "not listed (online read)", {"listed": sorted(listed)})

    def delete_random(self) -> None:
        if self.sessions:
            self.delete(self.rng.choice(sorted(self.sessions)))

    def delete(self, sid: str) -> None:
        self.pending_delete.add(sid)
        self.req("delete", "DELETE", f"/v1/sessions/{sid}", expect=(200, 404))
        self.pending_delete.discard(sid)
        gone = self.sessions.pop(sid, None)
        if gone is not None:
            self.deleted_markers.append(gone.marker)
        for k in [k for k in self.ledger if k[0] == sid]:
            del self.ledger[k]
        self.rec.count("deletes")

    def erase(self) -> None:
        """DELETE /v1/users/{me} with the admin key from this client's own thread (none of its
        requests in flight); the user then starts again from nothing, reusing its session ids."""
        self.pending_erase = True
        last = next((e for e in reversed(self.ledger.values()) if e.messages is not None), None)
        er = self.ctl.begin_erasure(self.user, "self")
        self.last_status = None
        gen0 = self.gate.gen
        try:
            r = self.req("erase", "DELETE", user_path(self.user), client=self.admin, race_ok=False)
        except Ambiguous:
            answered = self.last_status
            # A 4xx erased nothing: void. No answer or a 5xx: it may have erased (a hang may even
            # erase later: unknown). Answered either way, it is a finding already counted, and
            # not retried (a kill's cut erasure is).
            self.ctl.end_erasure(
                er, None, unknown=answered is None, void=answered is not None and answered < 500
            )
            if answered is not None and not (self.gate.down or self.gate.gen != gen0):
                self.pending_erase = False
            raise
        receipt = r.json()
        self.ctl.end_erasure(er, receipt)
        self.pending_erase = False
        self.receipts.append(receipt["id"])
        self.erased_markers += self.epoch_markers
        self.epoch_markers = []
        self.catch_up()
        self.sessions.clear()
        self.ledger.clear()
        self.responses.clear()
        self.pending_delete.clear()
        self.epoch += 1
        self.next_sid = 0  # the erased session ids are used again
        self.rec.count("erasures")
        left = self.req("erase_check", "GET", "/v1/sessions").json()["data"]
        if left and not self.raced():
            self.rec.count("leftovers", len(left))
            self.rec.event("sessions_after_erasure", user=self.user, sessions=[x["id"] for x in left])
        if last is not None and last.messages is not None:
            # The same prompt again: nothing of the erased user may be cached.
            prompt = last.messages[:-1]
            body = {"model": "default", "messages": prompt, "max_tokens": 1, "temperature": 0}
            usage = self.req("erase_check", "POST", "/v1/chat/completions", body).json()["usage"]
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if cached:
                self.rec.count("leftovers")
                self.rec.event("cached_after_erasure", user=self.user, cached_tokens=cached)

    def resync(self, s: Sess, ghost_from: int | None = None) -> None:
        """Re-read a session whose state is uncertain (never adds to the ledger)."""
        r = self.req("resync", "GET", f"/v1/sessions/{s.sid}", expect=(200, 404))
        if r.status_code == 404:
            entries = [e for (sid, _), e in self.ledger.items() if sid == s.sid]
            for e in entries:
                self.ctl.lost(self, e, "session gone (resync)", {})
            self.sessions.pop(s.sid, None)
            return
        info = r.json()
        count = int(info["version_count"])
        if ghost_from is not None and count > ghost_from and not self.raced():
            self.rec.count("ghost_commits", count - ghost_from)
        s.vcount = max(s.vcount, count)
        s.branches = {b["name"]: int(b["head_version"]) for b in info["branches"]}
        for head in set(s.branches.values()):
            if head > 0 and head not in s.known:
                v = self.req("resync", "GET", f"/v1/sessions/{s.sid}/versions/{head}").json()
                s.known[head] = v["messages"]
                s.parents[head] = v["parent"]
        s.dirty = False


# -------------------------------------------------------------------------------- operator
class Operator(Caller, threading.Thread):
    """The admin side, racing the clients: erasures of the users the traffic uses (now and then
    two or three of the same user at once, some with the user's own key), each receipt's
    verification read; the erasure list, public prefixes (create, list, delete), health, the
    console's files, the models list."""

    def __init__(self, ctl: Controller, seed: int, users: dict[str, str]) -> None:
        threading.Thread.__init__(self, name="soak-operator", daemon=True)
        Caller.__init__(self, ctl)
        self.rng = random.Random(f"{seed}-operator")
        self.users = users  # user -> key
        self.http = self.http_client(ctl.admin_key)
        self.prefixes: list[str] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            next_erase = self.rng.uniform(0.5, 1.5) * self.ctl.race_erase_every_s
            t = 0.0
            while not self.gate.stop.is_set():
                time.sleep(1.0)
                if not self.gate.is_open:
                    continue
                t += 1.0
                with self.gate.step(), contextlib.suppress(Ambiguous):
                    if t >= next_erase and self.users:
                        next_erase = t + self.rng.uniform(0.5, 1.5) * self.ctl.race_erase_every_s
                        self.erase_race()
                    elif self.rng.random() < 0.2:
                        self.admin_op()
        except Stopped:
            pass
        except BaseException as exc:
            import traceback

            self.error = exc
            self.rec.event("client_crash", user="operator", error=traceback.format_exc())
            self.rec.count("unexpected")

    def erase_race(self) -> None:
        user = self.rng.choice(sorted(self.users))
        k = self.rng.choices([1, 2, 3], [6, 3, 1])[0]
        threads = [
            threading.Thread(target=self.erase_one, args=(user, self.rng.random() < 0.3, k), daemon=True)
            for _ in range(k)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(self.ctl.deadline_s * 2 + 10)
        self.rec.count(f"race_erasures_x{k}")

    def erase_one(self, user: str, own_key: bool, together: int) -> None:
        """One DELETE /v1/users/{user}; the receipt's verification at once (`remnants_at_erasure`)."""
        er = self.ctl.begin_erasure(user, "user" if own_key else "admin", together)
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        key = self.users[user] if own_key else self.ctl.admin_key
        try:
            with self.http_client(key) as c:
                r = c.delete(user_path(user))
        except httpx.TimeoutException as exc:
            self.ctl.end_erasure(er, None, unknown=True)
            with self.lock, contextlib.suppress(Exception):
                self._outcome("race_erase", gen0, t0, exc, timeout=True)
            return
        except httpx.TransportError as exc:
            self.ctl.end_erasure(er, None)
            with self.lock, contextlib.suppress(Exception):
                self._outcome("race_erase", gen0, t0, exc, timeout=False)
            return
        with self.lock:
            self._check_time("race_erase", t0)
            if r.status_code != 200:
                self.ctl.end_erasure(er, None, void=r.status_code < 500)
                self.rec.event(
                    "race_erase_answer", user=user, by=er.by, together=together, status=r.status_code
                )
                with contextlib.suppress(Ambiguous):
                    self._status("race_erase", r.status_code, r.text, (200,))
                return
        receipt = r.json()
        self.ctl.end_erasure(er, receipt)
        self.rec.count("erasures")
        self.rec.count("race_erasures")

    def admin_op(self) -> None:
        op = self.rng.choice(["erasures", "receipt", "prefix", "prefix", "health", "console", "models"])
        if op == "erasures":
            body = self.req("erasure_list", "GET", "/v1/erasures?limit=5").json()
            if body.get("data") and self.rng.random() < 0.5:
                self.req("erasure_list", "GET", f"/v1/erasures?limit=5&after={body['data'][-1]['id']}")
        elif op == "receipt":
            rid = self.ctl.some_receipt(self.rng)
            if rid is not None:
                self.req("receipt", "GET", f"/v1/erasures/{rid}")
        elif op == "prefix":
            if len(self.prefixes) < 2 or self.rng.random() < 0.5:
                # A text prefix: no chat prompt starts with its tokens, so a prefix of the
                # template (`<|im_start|>system`) never shows as cached in an erasure's checks.
                text = "Soak museum front desk. " + " ".join(
                    f"Room {i} shows {self.rng.choice(ITEMS)} from {1700 + 7 * i}." for i in range(40)
                )
                body = {"text": text, "pin": self.rng.random() < 0.25}
                pid = self.req("prefix_create", "POST", "/v1/prefixes", body, expect=(201,)).json()["id"]
                self.prefixes.append(pid)
            else:
                pid = self.prefixes.pop(0)
                self.req("prefix_delete", "DELETE", f"/v1/prefixes/{pid}", expect=(200, 404))
            self.req("prefix_list", "GET", "/v1/prefixes")
        elif op == "health":
            self.req("health", "GET", "/healthz")
            self.req("health", "GET", "/readyz")
        elif op == "console":
            self.req("console", "GET", "/console")
            self.req("console", "GET", "/console/", expect=(200, 307))
            self.req("console", "GET", f"/console/{self.rng.choice(['app.js', 'style.css', 'index.html'])}")
        else:
            self.req("models", "GET", "/v1/models")


def same_content(listed: Messages, e: Entry) -> bool:
    """A version's messages as read back against the ledger: all of them, or (a response) the
    answer, its last message."""
    if e.messages is not None:
        return listed == e.messages
    return bool(listed) and listed[-1].get("content") == e.text


# -------------------------------------------------------------------------------- controller
class Controller:
    def __init__(self, args: argparse.Namespace, out: Path, data_dir: Path) -> None:
        self.args = args
        self.out = out
        self.data_dir = data_dir
        self.deadline_s = float(args.deadline_s)
        self.replay_fraction = float(args.replay_fraction)
        self.erase_weight = float(args.erase_weight)
        self.alt_seed = bool(args.alt_seed)
        self.race_erase_every_s = float(args.race_erase_every_s)
        self.erasure_lock = threading.Lock()
        self.erasures: dict[str, list[Erasure]] = {}
        self.receipts: list[tuple[str, str]] = []  # (user, receipt id) of every erasure answered
        self.gate = Gate()
        self.rec = Recorder(out / "events.jsonl")
        self.lost_keys: set[tuple[str, int, int, str]] = set()
        self.lost_lock = threading.Lock()
        self.restart_failures = 0
        self.verified = 0
        t0 = time.monotonic()
        self.admin_key = create_key(data_dir, None)
        self.replay_key = create_key(data_dir, "soak-replay")
        users, keys = [], []
        for i in range(args.clients):
            user, key = f"soak-user-{i}", None
            if i == 1 and args.odd_user_id:
                # A user id with a slash and an at sign (issue 19, item 1): every id the server
                # accepts must be erasable; where `dss keys create` refuses it, a plain one.
                key = try_create_key(data_dir, ODD_USER)
                user = ODD_USER if key is not None else user
                print(
                    f"user id {ODD_USER!r}: {'accepted' if key else 'refused by dss keys create'}", flush=True
                )
            users.append(user)
            keys.append(key or create_key(data_dir, user))
        print(f"created {len(keys) + 2} API keys in {time.monotonic() - t0:.1f} s", flush=True)
        port = args.port or free_port()
        self.server = Server(data_dir, port, out / "server.log", self.admin_key)
        self.clients = [
            Client(i, u, k, self, args.seed) for i, (u, k) in enumerate(zip(users, keys, strict=True))
        ]
        racing = dict(zip(users, keys, strict=True)) if self.race_erase_every_s > 0 else {}
        self.operator = Operator(self, args.seed, racing)

    # ----------------------------------------------------------------------------- erasures
    def begin_erasure(self, user: str, by: str, together: int = 1) -> Erasure:
        with self.erasure_lock:
            er = Erasure(user, time.monotonic(), by=by, together=together)
            self.erasures.setdefault(user, []).append(er)
            return er

    def end_erasure(
        self, er: Erasure, receipt: dict[str, Any] | None, unknown: bool = False, void: bool = False
    ) -> None:
        """Its answer (a receipt), or none: `unknown` when it may still commit (a hang), `void`
        when it was refused (4xx: nothing erased)."""
        if receipt is not None:
            ver = receipt.get("verification") or {}
            bad = int(ver.get("remnants") or 0) + (0 if ver.get("chain_ok") else 1)
            if bad:
                self.rec.count("remnants_at_erasure", bad)
                self.rec.event(
                    "erasure_remnants",
                    user=er.user,
                    by=er.by,
                    together=er.together,
                    took_s=round(time.monotonic() - er.s, 3),
                    receipt=receipt.get("id"),
                    verification=ver,
                )
        with self.erasure_lock:
            er.void = void
            er.e = float("inf") if unknown else time.monotonic()
            if receipt is not None and isinstance(receipt.get("id"), str):
                er.receipt = receipt["id"]
                self.receipts.append((er.user, receipt["id"]))

    def erasures_of(self, user: str) -> list[Erasure]:
        with self.erasure_lock:
            return list(self.erasures.get(user, []))

    def erasures_started(self, user: str) -> int:
        with self.erasure_lock:
            return len(self.erasures.get(user, []))

    def some_receipt(self, rng: random.Random) -> str | None:
        with self.erasure_lock:
            return rng.choice(self.receipts)[1] if self.receipts else None

    def erased_since(self, user: str, q: float) -> bool:
        """An erasure of `user` began by now and had not ended when `q` (a request) was sent:
        what that request wrote may be gone legitimately."""
        with self.erasure_lock:
            return any(not er.void and (er.e is None or er.e > q) for er in self.erasures.get(user, []))

    def lost(self, client: Client, e: Entry, why: str, detail: dict[str, Any]) -> None:
        client.ledger.pop((e.sid, e.number), None)
        if self.erased_since(client.user, e.q):
            self.rec.count("erased_versions")  # its user was erased after it was sent
            return
        key = (client.user, client.epoch, e.number, e.sid)
        with self.lost_lock:
            if key in self.lost_keys:
                return
            self.lost_keys.add(key)
        client.ledger.pop((e.sid, e.number), None)
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

    # ------------------------------------------------------------------------------ checking
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

    def verify_ledgers(self, phase: str) -> int:
        """Every acknowledged version must still be listed, with its parent, branch, messages."""
        checked = 0
        for c in self.clients:
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

    def db_scan(self) -> tuple[int, int]:
        """Erased sessions' marker strings in the SQLite files (and, for information, deleted ones')."""
        blobs = b""
        for p in sorted(self.data_dir.glob("dss.sqlite3*")):
            with contextlib.suppress(OSError):
                blobs += p.read_bytes()
        erased = deleted = 0
        for c in self.clients:
            for mk in c.erased_markers:
                n = blobs.count(mk.encode())
                if n:
                    erased += n
                    self.rec.event("db_marker_after_erasure", user=c.user, marker=mk, hits=n)
            for mk in c.deleted_markers:
                deleted += blobs.count(mk.encode())
        return erased, deleted

    def reverify_receipts(self) -> int:
        """Every receipt's fresh verification (`GET /v1/erasures/{id}`), with the traffic settled:
        the sum of their remnants (a receipt that cannot be read or whose chain is broken: 1)."""
        bad = 0
        admin = self.operator.http
        with self.erasure_lock:
            receipts = list(self.receipts)
        for user, rid in receipts:
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

    # ------------------------------------------------------------------------------ the run
    def pause(self) -> None:
        if not self.gate.close(self.deadline_s * 3 + 30):
            self.rec.count("hangs")
            self.rec.event("pause_timeout", inflight=self.gate.inflight)
            self.gate.close(600)

    def kill_and_restart(self) -> bool:
        self.server.scrape()
        with self.gate.cond:
            self.gate.is_open = False
            self.gate.down = True
            self.gate.gen += 1
        t0 = time.monotonic()
        self.server.kill()
        self.pause()
        try:
            self.server.start()
        except RuntimeError as exc:
            self.restart_failures += 1
            self.rec.event("restart_failed", error=str(exc), log=self.log_tail())
            print(f"restart failed: {exc}", flush=True)
            return False
        self.gate.down = False
        for c in self.clients:
            c.resolve()
        checked = self.verify_ledgers(f"after restart {self.server.starts - 1}")
        self.rec.count("restarts")
        print(
            f"  restart #{self.server.starts - 1}: down {time.monotonic() - t0:.0f} s "
            f"(ready in {self.server.start_seconds[-1]:.0f} s), {checked} versions checked",
            flush=True,
        )
        return True

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.server.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def progress(self, run_s: float) -> None:
        c = self.rec.counts
        print(
            f"[{run_s:6.0f} s] requests={c['requests']} acked={c['acked_versions']} "
            f"interrupted={c['interrupted']} 5xx={c['errors_5xx']} hangs={c['hangs']} "
            f"lost={c['lost_versions']} unexpected={c['unexpected']} erasures={c['erasures']} "
            f"erased_4xx={c['erased_4xx']} "
            f"greedy={c['greedy_mismatch']}/{c['greedy_checked']} restarts={c['restarts']}",
            flush=True,
        )

    def run(self) -> int:
        args = self.args
        rng = random.Random(f"{args.seed}-kills")
        t_start = time.monotonic()
        print(f"starting the server on port {self.server.port} (data {self.data_dir})", flush=True)
        self.server.start()
        print(f"ready in {self.server.start_seconds[-1]:.0f} s; {args.clients} clients", flush=True)
        for c in self.clients:
            c.start()
        self.operator.start()
        self.gate.open()
        run_s, kills = 0.0, 0
        next_kill = args.kill_every_s * rng.uniform(0.8, 1.2) if args.kill_every_s > 0 else float("inf")
        last_scrape = last_print = 0.0
        while run_s < args.duration_s:
            time.sleep(1.0)
            run_s += 1.0
            if run_s - last_scrape >= 5:
                self.server.scrape()
                last_scrape = run_s
            if run_s - last_print >= 30:
                self.progress(run_s)
                last_print = run_s
            can_kill = args.max_kills < 0 or kills < args.max_kills
            if can_kill and run_s >= next_kill and run_s < args.duration_s - 5:
                kills += 1
                if not self.kill_and_restart():
                    break
                self.gate.open()
                next_kill = run_s + args.kill_every_s * rng.uniform(0.8, 1.2)
        # --------------------------------------------------------------------- final checks
        self.pause()
        self.gate.stop.set()
        for th in [*self.clients, self.operator]:
            th.join(30)
        final_checked = receipts_bad = erased_hits = deleted_hits = 0
        if self.server.proc is not None:
            self.server.scrape()
            for c in self.clients:
                c.resolve()
            final_checked = self.verify_ledgers("final")
            receipts_bad = self.reverify_receipts()
            erased_hits, deleted_hits = self.db_scan()
        stop_rc, stop_s = self.server.stop()
        counts = self.rec.counts
        log_text = self.server.log_path.read_text(errors="replace") if self.server.log_path.exists() else ""
        tracebacks = log_text.count("Traceback (most recent call last)")
        m = self.server.metrics_total
        result = {
            "requests": counts["requests"],
            "hangs": counts["hangs"],
            "errors_5xx": counts["errors_5xx"],
            "lost_versions": counts["lost_versions"],
            "corrupt_served": int(m["dss_corrupt_pages_total"]) + counts["corrupt_answers"],
            "remnants": receipts_bad,
            "restarts": counts["restarts"],
        }
        detail = {
            "unexpected": counts["unexpected"],  # client crashes (a bug of the soak) included
            "restart_failures": self.restart_failures,
            "remnants_at_erasure": counts["remnants_at_erasure"],
            "pre_erasure_kept": counts["pre_erasure_kept"],
            "leftovers": counts["leftovers"] + erased_hits,
            "erasures": counts["erasures"],
            "race_erasures": counts["race_erasures"],
            "erased_4xx": counts["erased_4xx"],
            "erased_aborted": counts["erased_aborted"],
            "erased_versions": counts["erased_versions"],
            "acked_during_erasure": counts["acked_during_erasure"],
            "corrupt_pages": int(m["dss_corrupt_pages_total"]),
            "corrupt_answers": counts["corrupt_answers"],
            "greedy_checked": counts["greedy_checked"],
            "greedy_mismatch": counts["greedy_mismatch"],
            "greedy_prompt_differs": counts["greedy_prompt_differs"],
            "greedy_checked_loaded": counts["greedy_checked_loaded"],
            "greedy_mismatch_loaded": counts["greedy_mismatch_loaded"],
            "acked_versions": counts["acked_versions"],
            "verified_versions": self.verified,
            "final_verified": final_checked,
            "interrupted": counts["interrupted"],
            "responses_stored": counts["responses_stored"],
            "response_deletes": counts["response_deletes"],
            "deletes": counts["deletes"],
            "rollbacks": counts["rollbacks"],
            "branches": counts["branches"],
            "disconnects": counts["disconnects"],
            "ghost_commits": counts["ghost_commits"],
            "other_parent": counts["other_parent"],
            "server_5xx": int(m["server_5xx"]),
            "store_errors": int(m["dss_connector_store_errors_total"]),
            "disk_write_errors": int(m["dss_disk_write_errors_total"]),
            "evictions": int(m["evictions"]),
            "db_marker_hits": erased_hits,
            "deleted_marker_hits": deleted_hits,
            "server_tracebacks": tracebacks,
            "stop_rc": stop_rc,
            "stop_s": round(stop_s, 1),
            "wall_s": round(time.monotonic() - t_start),
        }
        summary = {
            "result": result,
            "detail": detail,
            "counts": dict(counts),
            "metrics_total": dict(m),
            "start_seconds": [round(x, 1) for x in self.server.start_seconds],
            "latency_s": self.rec.latency_summary(),
            "server_root": str(_soak_server.SERVER_ROOT),
            "examples": self.rec.examples,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        for kind, ex in self.rec.examples.items():
            if kind in ("greedy_mismatch",):
                continue
            print(f"--- {kind} ({len(ex)} shown):", flush=True)
            for e in ex[:5]:
                print("   ", json.dumps(e, default=str)[:1500], flush=True)
        if tracebacks:
            first = log_text.index("Traceback (most recent call last)")
            print("--- first server traceback:\n" + log_text[first : first + 4000], flush=True)
        for kind, lat in summary["latency_s"].items():
            print(
                f"latency {kind}: n={lat['n']} p50={lat['p50']} p99={lat['p99']} max={lat['max']} s",
                flush=True,
            )
        routes = sorted(k[len("5xx by route: ") :] for k in m if k.startswith("5xx by route: "))
        if routes:
            print("server 5xx by route: " + ", ".join(f"{r} x{int(m['5xx by route: ' + r])}" for r in routes))
        print(f"out: {self.out}", flush=True)
        failed = [k for k in FAIL_KEYS if {**result, **detail}[k]]
        print("DETAIL " + " ".join(f"{k}={v}" for k, v in detail.items()), flush=True)
        print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of traffic (restarts excluded)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--kill-every-s", type=float, default=90.0, help="SIGKILL period (+-20 %%); 0 = never")
    p.add_argument("--max-kills", type=int, default=-1, help="at most this many kills (-1 = no limit)")
    p.add_argument("--data-dir", type=Path, default=None, help="a new or empty folder (default: OUT/data)")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="summary.json, events.jsonl, server.log")
    p.add_argument("--deadline-s", type=float, default=60.0, help="client deadline of every request")
    p.add_argument("--replay-fraction", type=float, default=0.25, help="non-streamed turns replayed cold")
    p.add_argument(
        "--erase-weight", type=float, default=1.0, help="weight of a client erasing itself (chat turns: 20)"
    )
    p.add_argument(
        "--alt-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="`n` = 2 alternatives carry a `seed` (the CPU engine of vLLM 0.32 dies on a seeded "
        "request whose prefill is chunked: --no-alt-seed to get past that)",
    )
    p.add_argument(
        "--odd-user-id",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"client 1 is the user {ODD_USER!r} (if `dss keys create` accepts it)",
    )
    p.add_argument(
        "--race-erase-every-s",
        type=float,
        default=20.0,
        help="mean period of erasures racing the traffic (+-50 %%; 1-3 at once); 0 = none",
    )
    p.add_argument(
        "--server-root",
        type=Path,
        default=os.environ.get("DSS_SOAK_SERVER_ROOT") or None,
        help="run this copy of the code (default: $DSS_SOAK_SERVER_ROOT, else the checkout)",
    )
    args = p.parse_args(argv)
    if args.server_root is not None:
        _soak_server.use_server_root(args.server_root)
    out = args.out or Path(tempfile.mkdtemp(prefix="dss-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("events.jsonl", "server.log", "summary.json"):
        (out / name).unlink(missing_ok=True)
    data_dir = args.data_dir or out / "data"
    if data_dir.exists() and any(data_dir.iterdir()):
        raise SystemExit(f"{data_dir} is not empty: the soak needs a fresh data directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    ctl = Controller(args, out, data_dir)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return ctl.run()
    finally:
        ctl.gate.stop.set()
        ctl.server.kill()


if __name__ == "__main__":
    sys.exit(main())
