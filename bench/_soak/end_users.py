"""The soak's frontend: one thread acting for a few end users through one frontend key
(docs/frontends.md), each end user named per request by `X-DSS-User`, the frontend's own user
header or the body's `user`. Their traffic: chat turns in sessions named by the body's
`session_id`, `X-DSS-Session` or the frontend's session header; the Conversations API (create,
add items, delete an item, delete the conversation); Responses in a conversation; reads of their
own things and of each other's (`EndUserChecks.peek`). Every `--race-erase-every-s` (+-50 %) of
its traffic it erases one of them through the frontend key (`DELETE /v1/users/{end user}`) while
a write of that end user runs, then checks that nothing of before is visible any more
(`EndUserChecks.catch_up`).

What each end user holds is `EndUser.held` (model): only what the server acknowledged; an
erasure empties it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from .calls import Ambiguous, Caller, Stopped
from .end_user_checks import EndUserChecks
from .model import ITEMS, QUESTIONS, EndUser, Held, Messages
from .server import user_path

if TYPE_CHECKING:
    from .controller import Controller

FRONTEND = "soak-fe"
USER_HEADER = "X-Soak-User"  # the frontend's own header naming the end user
SESSION_HEADER = "X-Soak-Chat"  # the frontend's own header naming the session
# An `@`, a `.`, a `'` and a `+`: every id the rule accepts must be erasable by its frontend.
END_USER_NAMES = ("ana", "bo@soak.example", "cy.o'neil+1")
MAX_HELD = 2  # sessions, and conversations, per end user


class EndUsers(Caller, threading.Thread):
    """The frontend's traffic, one end user at a time (`self.user` is the end user the current
    request acts for: `Caller` classifies its 4xx against that end user's erasures)."""

    def __init__(self, ctl: Controller, seed: int, names: tuple[str, ...]) -> None:
        threading.Thread.__init__(self, name="soak-frontend", daemon=True)
        Caller.__init__(self, ctl)
        self.rng = random.Random(f"{seed}-frontend")
        self.users = [EndUser(n, f"{FRONTEND}/{n}") for n in names]
        self.current = self.users[0]
        self.user = self.current.label
        self.http = self.http_client(ctl.frontend_key)  # names no end user: each request does
        self.replay = self.http_client(ctl.replay_key)  # a plain user, for reads across
        self.checks = EndUserChecks(self)
        self.next_id = 0
        self.active_s = 0.0  # seconds of its own steps: the erasure clock
        period = ctl.race_erase_every_s
        self.erase_period = period if period > 0 else float("inf")
        self.next_erase = self.rng.uniform(0.5, 1.5) * self.erase_period
        self.error: BaseException | None = None
        self.pending_marker: str | None = None  # the marker of the text the next write sends

    # ------------------------------------------------------------------------------ the thread
    def run(self) -> None:
        try:
            while not self.gate.stop.is_set():
                with self.gate.step():
                    t0 = time.monotonic()
                    self.step()
                    self.active_s += time.monotonic() - t0
        except Stopped:
            pass
        except BaseException as exc:  # a bug in the soak itself: report it, do not hide it
            import traceback

            self.error = exc
            self.rec.event("client_crash", user="frontend", error=traceback.format_exc())
            self.rec.count("unexpected")

    def seen_erasures(self) -> int:
        return self.current.processed

    def act_as(self, u: EndUser) -> None:
        self.current, self.user = u, u.label

    OPS: tuple[tuple[str, float], ...] = (
        ("chat", 6),
        ("conv_create", 3),
        ("conv_items", 4),
        ("conv_respond", 4),
        ("item_delete", 1),
        ("conv_delete", 1),
        ("read", 3),
        ("peek", 2),
    )

    def step(self) -> None:
        try:
            for u in self.users:
                self.checks.catch_up(u)
            u = self.rng.choice(self.users)
            self.act_as(u)
            if self.active_s >= self.next_erase:
                self.next_erase = self.active_s + self.rng.uniform(0.5, 1.5) * self.erase_period
                self.erase_race(u)
                return
            op = self.rng.choices([o for o, _ in self.OPS], [w for _, w in self.OPS])[0]
            self.rec.count(f"op_frontend_{op}")
            self.ops()[op](u)
        except Ambiguous:
            time.sleep(0.2)

    def ops(self) -> dict[str, Callable[[EndUser], None]]:
        return {
            "chat": self.chat,
            "conv_create": self.conv_create,
            "conv_items": self.conv_items,
            "conv_respond": self.conv_respond,
            "item_delete": self.item_delete,
            "conv_delete": self.conv_delete,
            "read": self.checks.read_own,
            "peek": self.checks.peek,
        }

    def resolve(self) -> None:
        """After a restart and before a check (the controller calls it while this thread is paused)."""
        for u in self.users:
            self.act_as(u)
            with contextlib.suppress(Ambiguous):
                self.checks.catch_up(u)

    # ------------------------------------------------------------------------------- requests
    def identity(self, u: EndUser, body: dict[str, Any] | None, body_ok: bool) -> dict[str, str]:
        """Name the end user: `X-DSS-User`, the frontend's header, or (`body_ok`) the body's `user`."""
        r = self.rng.random()
        if body_ok and body is not None and r < 0.3:
            body["user"] = u.name
            return {}
        return {"X-DSS-User" if r < 0.65 else USER_HEADER: u.name}

    def write(
        self,
        u: EndUser,
        touched: list[Held],
        kind: str,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """A write of `u`'s: when it was sent and ended (answered, refused or cut) is kept on what
        it names (`touched`), whatever its outcome."""
        u.last_write_q = time.monotonic()
        for h in touched:
            h.q = u.last_write_q
        try:
            return self.req(kind, method, path, body, headers=headers or self.identity(u, None, False))
        finally:
            end = time.monotonic()
            for h in touched:
                h.q, h.end = self.last_q, end
            u.last_write_q = self.last_q
            if self.pending_marker is not None:
                u.markers.append((self.pending_marker, end))
                self.pending_marker = None

    def text(self, u: EndUser) -> str:
        self.next_id += 1
        mark = f"zfe{self.users.index(u)}x{self.rng.getrandbits(40):010x}"
        self.pending_marker = mark
        return f"[{mark}] #{self.next_id} {self.rng.choice(QUESTIONS)}"

    # ----------------------------------------------------------------------------- operations
    def chat(self, u: EndUser) -> None:
        """A chat turn in a session: a new one, or the next turn of one it holds."""
        sessions = [h for h in u.of_kind("session") if h.messages]
        new = not sessions or (len(u.of_kind("session")) < MAX_HELD and self.rng.random() < 0.4)
        if new:
            self.next_id += 1
            sid = f"fe-{self.next_id}"
            facts = " ".join(
                f"Box {k} holds {self.rng.choice(ITEMS)}." for k in range(self.rng.randint(4, 12))
            )
            base: Messages = [{"role": "system", "content": f"You keep the notes of {sid}. {facts}"}]
            h = Held("session", sid, None, 0.0, 0.0, acked=False)
            u.held[("session", sid)] = h
        else:
            h = self.rng.choice(sessions)
            base = h.messages
        sent = [*base, {"role": "user", "content": self.text(u)}]
        body: dict[str, Any] = {
            "model": "default",
            "messages": sent,
            "max_tokens": self.rng.choice([4, 6, 8]),
            "temperature": 0,
        }
        headers = self.identity(u, body, True)
        where = self.rng.random()
        if where < 1 / 3:
            body["session_id"] = h.id
        else:
            headers["X-DSS-Session" if where < 2 / 3 else SESSION_HEADER] = h.id
        data = self.write(u, [h], "frontend_chat", "POST", "/v1/chat/completions", body, headers).json()
        if not isinstance(data.get("state_version"), int) or data.get("session_id") != h.id:
            self.rec.count("unexpected")
            self.rec.event("frontend_chat_without_version", user=u.label, session=h.id, data=str(data)[:800])
            return
        answer = data["choices"][0]["message"]["content"] or ""
        h.messages, h.acked = [*sent, {"role": "assistant", "content": answer}], True
        self.rec.count("end_user_acked")

    def conv_create(self, u: EndUser) -> None:
        if len(u.of_kind("conversation")) >= MAX_HELD:
            self.conv_items(u)
            return
        body = {"items": [{"role": "user", "content": self.text(u)}], "metadata": {"soak": u.name[:60]}}
        data = self.write(u, [], "frontend_conv_create", "POST", "/v1/conversations", body).json()
        cid = data.get("id")
        if not isinstance(cid, str):
            self.rec.count("unexpected")
            self.rec.event("conversation_without_id", user=u.label, data=str(data)[:800])
            return
        u.held[("conversation", cid)] = Held("conversation", cid, None, self.last_q, time.monotonic())
        self.rec.count("end_user_acked")

    def conv_items(self, u: EndUser) -> None:
        convs = u.of_kind("conversation")
        if not convs:
            self.conv_create(u)
            return
        c = self.rng.choice(convs)
        body = {"items": [{"role": "user", "content": self.text(u)}]}
        path = f"/v1/conversations/{c.id}/items"
        data = self.write(u, [c], "frontend_conv_items", "POST", path, body).json()
        for item in data.get("data") or []:
            u.held[("item", item["id"])] = Held("item", item["id"], c.id, c.q, c.end)
        self.rec.count("end_user_acked")

    def conv_respond(self, u: EndUser) -> None:
        """A response in a conversation: its output item joins the conversation."""
        convs = u.of_kind("conversation")
        if not convs:
            self.conv_create(u)
            return
        c = self.rng.choice(convs)
        body: dict[str, Any] = {
            "model": "default",
            "input": self.text(u),
            "instructions": "Answer in a few words.",
            "conversation": c.id,
            "max_output_tokens": self.rng.choice([4, 6, 8]),
            "temperature": 0,
        }
        headers = self.identity(u, body, True)
        data = self.write(u, [c], "frontend_respond", "POST", "/v1/responses", body, headers).json()
        rid, output = data.get("id"), data.get("output") or []
        if not isinstance(rid, str) or (data.get("conversation") or {}).get("id") != c.id:
            self.rec.count("unexpected")
            self.rec.event(
                "frontend_response_not_in_conversation", user=u.label, conv=c.id, data=str(data)[:800]
            )
            return
        u.held[("response", rid)] = Held("response", rid, c.id, c.q, c.end)
        if output and isinstance(output[0].get("id"), str):
            u.held[("item", output[0]["id"])] = Held("item", output[0]["id"], c.id, c.q, c.end)
        self.rec.count("end_user_acked")

    def item_delete(self, u: EndUser) -> None:
        items = u.of_kind("item")
        if not items:
            return
        it = self.rng.choice(items)
        conv = u.held.get(("conversation", it.conv or ""))
        touched = [it] + ([conv] if conv is not None else [])
        self.write(u, touched, "frontend_item_delete", "DELETE", f"/v1/conversations/{it.conv}/items/{it.id}")
        u.held.pop(("item", it.id), None)

    def conv_delete(self, u: EndUser) -> None:
        """Delete a conversation: its items and the responses made in it go with it."""
        convs = u.of_kind("conversation")
        if not convs:
            return
        c = self.rng.choice(convs)
        self.write(u, [c], "frontend_conv_delete", "DELETE", f"/v1/conversations/{c.id}")
        for key in [k for k, h in u.held.items() if h.id == c.id or h.conv == c.id]:
            del u.held[key]
        self.checks.gone_after_delete(u, c)

    # ------------------------------------------------------------------------ racing erasure
    def erase_race(self, u: EndUser) -> None:
        """Erase `u` through the frontend key while a write of `u` runs (the erasure is sent
        0-1.5 s after a generating write, 0-30 ms after a conversation write), then check what
        the erasure left (`EndUserChecks.catch_up`)."""
        write = self.rng.choice([self.chat, self.conv_respond, self.conv_items, self.conv_create])
        # A generation takes seconds here, a conversation write milliseconds: both must be hit.
        generates = write in (self.chat, self.conv_respond)
        delay = self.rng.uniform(0.0, 1.5) if generates else self.rng.uniform(0.0, 0.03)
        eraser = threading.Thread(target=self.erase, args=(u, delay), name="soak-frontend-erase", daemon=True)
        eraser.start()
        with contextlib.suppress(Ambiguous):
            write(u)
        eraser.join(self.ctl.deadline_s * 2 + 10)
        self.rec.count("end_user_race_erasures")
        self.checks.catch_up(u)

    def erase(self, u: EndUser, delay: float) -> None:
        """One `DELETE /v1/users/{end user}` with the frontend key, recorded in the run's
        `ErasureLog` under the end user's DSS user id (its own thread: no `Caller` state)."""
        if self.gate.stop.wait(delay):
            return
        er = self.ctl.erasures.begin(u.label, "frontend")
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        try:
            with self.http_client(self.ctl.frontend_key) as c:
                r = c.delete(user_path(u.name))
        except httpx.HTTPError as exc:
            cut = self.gate.down or self.gate.gen != gen0
            hang = isinstance(exc, httpx.TimeoutException)
            self.ctl.erasures.end(er, None, unknown=hang)
            self.rec.count("interrupted" if cut else "hangs" if hang else "unexpected")
            if not cut:
                self.rec.event("frontend_erase_no_answer", user=u.label, error=repr(exc))
            return
        self.rec.latency("frontend_erase", time.monotonic() - t0)
        if r.status_code != 200:
            self.ctl.erasures.end(er, None, void=r.status_code < 500)
            self.rec.count("errors_5xx" if r.status_code >= 500 else "unexpected")
            self.rec.event("frontend_erase_answer", user=u.label, status=r.status_code, body=r.text[:1000])
            return
        receipt = r.json()
        self.ctl.erasures.end(er, receipt)
        self.rec.count("end_user_erasures")
        self.rec.count("end_user_erasures_held_nothing", 1 if receipt.get("held_nothing") else 0)
