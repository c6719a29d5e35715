"""The soak's client plumbing (`bench/soak.py`): the gate the controller closes to restart the
server, the recorder of counts and events, and `Caller`, a thread of requests with a deadline each
whose answers are classified (a kill, a hang, a 5xx, a 4xx that an erasure racing it explains)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from .controller import Controller

# What a request of a user whose erasure raced it may answer: the session, version or response
# is gone (404), the generation was stopped or its commit refused (409), gone for good (410).
ERASE_RACE_STATUSES = (404, 409, 410)


class Stopped(Exception):
    """The run is over; the client thread leaves."""


class Ambiguous(Exception):
    """A request whose outcome the client does not know (cut by a kill, 5xx, hang, odd answer)."""


# ---------------------------------------------------------------------------------- the gate
class Gate:
    """Clients run steps only while the gate is open; the controller closes it (and waits for the
    steps in flight) to restart the server or to check the ledger."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.is_open = False
        self.inflight = 0
        self.down = False  # the server is being killed / restarted
        self.gen = 0  # bumped at every kill
        self.stop = threading.Event()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self.cond:
            while not self.is_open:
                if self.stop.is_set():
                    raise Stopped
                self.cond.wait(0.5)
            self.inflight += 1
        try:
            yield
        finally:
            with self.cond:
                self.inflight -= 1
                self.cond.notify_all()

    def close(self, timeout: float) -> bool:
        with self.cond:
            self.is_open = False
            end = time.monotonic() + timeout
            while self.inflight > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def open(self) -> None:
        with self.cond:
            self.is_open = True
            self.cond.notify_all()


# --------------------------------------------------------------------------------- recording
class Recorder:
    def __init__(self, path: Path) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.path = path
        self.examples: dict[str, list[dict[str, Any]]] = {}
        self.latencies: dict[str, list[float]] = {}

    def latency(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)

    def latency_summary(self) -> dict[str, dict[str, float]]:
        out = {}
        with self.lock:
            for kind, xs in sorted(self.latencies.items()):
                xs = sorted(xs)
                out[kind] = {
                    "n": len(xs),
                    "p50": round(xs[len(xs) // 2], 3),
                    "p99": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
                    "max": round(xs[-1], 3),
                }
        return out

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def event(self, kind: str, keep: int = 20, **info: Any) -> None:
        rec = {"t": time.strftime("%H:%M:%S"), "kind": kind, **info}
        line = json.dumps(rec, default=str)
        with self.lock:
            ex = self.examples.setdefault(kind, [])
            if len(ex) < keep:
                ex.append(rec)
            with open(self.path, "a") as f:
                f.write(line + "\n")


# ------------------------------------------------------------------------------------ callers
@dataclass
class Erasure:
    """One `DELETE /v1/users/{user}` of the run: sent at `s`, answered at `e` (None while in flight;
    +inf when its outcome stays unknown: a hang could still commit it later)."""

    user: str
    s: float
    e: float | None = None
    receipt: str | None = None
    by: str = "admin"
    together: int = 1  # erasures of the same user sent at the same moment
    void: bool = False  # answered 4xx: it erased nothing
    held_nothing: bool = False  # answered 200 without a receipt: the server held nothing of the user


class Caller:
    """A thread of requests with a client deadline each, classified into counts and events.

    A 4xx answer (404, 409, 410) to a user whose erasure began after the caller last caught up
    with that user's erasures (`n0`: `ErasureLog.started` when the request was sent) is
    the erasure winning a race, not an error: `erased_4xx`, and the request's outcome is left to
    the next re-read (`Ambiguous`)."""

    user: str = ""

    def __init__(self, ctl: Controller) -> None:
        self.ctl, self.gate, self.rec = ctl, ctl.gate, ctl.rec
        self.n0 = 0  # erasures of self.user known to this caller when its request was sent
        self.last_status: int | None = None  # of the last `req` answered
        self.last_q = 0.0  # when the last request was sent (a version's "request start")

    def http_client(self, key: str) -> httpx.Client:
        timeout = httpx.Timeout(self.ctl.deadline_s, connect=10.0)
        return httpx.Client(
            base_url=self.ctl.server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def seen_erasures(self) -> int:
        return 0

    def raced(self) -> bool:
        """An erasure of this caller's user began after it last caught up (maybe during the request)."""
        return bool(self.user) and self.ctl.erasures.started(self.user) > self.n0

    def start_request(self) -> tuple[int, float]:
        """A request about to be sent: counted, its send time kept; (the kill generation, the time)."""
        self.n0 = self.seen_erasures()
        t0 = time.monotonic()
        self.last_q = t0
        self.rec.count("requests")
        return self.gate.gen, t0

    def no_answer(self, kind: str, gen0: int, t0: float, exc: BaseException, timeout: bool) -> Ambiguous:
        """Classify a request that got no answer."""
        took = time.monotonic() - t0
        if self.gate.down or self.gate.gen != gen0:
            self.rec.count("interrupted")
            return Ambiguous(f"{kind}: cut by a kill")
        if timeout:
            self.rec.count("hangs")
            self.rec.event("hang", user=self.user, op=kind, seconds=round(took, 1), error=repr(exc))
        else:
            self.rec.count("unexpected")
            self.rec.event("connection_error", user=self.user, op=kind, error=repr(exc))
        return Ambiguous(f"{kind}: {exc!r}")

    def check_time(self, kind: str, t0: float) -> None:
        took = time.monotonic() - t0
        self.rec.latency(kind, took)
        if took > self.ctl.deadline_s:
            self.rec.count("hangs")
            self.rec.event("hang", user=self.user, op=kind, seconds=round(took, 1), note="answered late")

    def on_erased_answer(self) -> None:
        """A request lost a race with an erasure of this user (the client re-reads its state)."""

    def check_status(
        self, kind: str, status: int, body: str, expect: tuple[int, ...], race_ok: bool = True
    ) -> None:
        """Classify an answer's status: none of `expect` raises `Ambiguous` after counting it as a
        5xx, an erasure winning a race (`erased_4xx`) or `unexpected`."""
        if status in expect:
            return
        if status >= 500:
            self.rec.count("errors_5xx")
            self.rec.event("5xx", user=self.user, op=kind, status=status, body=body[:2000])
        elif status in ERASE_RACE_STATUSES and race_ok and self.raced():
            self.rec.count("erased_4xx")
            self.rec.count(f"erased_4xx {kind} {status}")
            self.rec.event("erased_4xx", keep=8, user=self.user, op=kind, status=status, body=body[:500])
            self.on_erased_answer()
        else:
            self.rec.count("unexpected")
            self.rec.event("unexpected_status", user=self.user, op=kind, status=status, body=body[:2000])
        raise Ambiguous(f"{kind}: {status}")

    def _stream_error(self, kind: str, gen0: int, error: Any) -> Ambiguous:
        """An `error` event inside a stream: a kill, a lost race with an erasure, or a finding."""
        if self.gate.down or self.gate.gen != gen0:
            self.rec.count("interrupted")
        elif self.raced():
            self.rec.count("erased_aborted")
            self.rec.event("erased_aborted", keep=8, user=self.user, op=kind, error=str(error)[:500])
            self.on_erased_answer()
        else:
            self.rec.count("unexpected")
            self.rec.event("stream_error", user=self.user, op=kind, error=str(error)[:2000])
        return Ambiguous(kind)

    def req(
        self,
        kind: str,
        method: str,
        path: str,
        body: Any = None,
        expect: tuple[int, ...] = (200,),
        client: httpx.Client | None = None,
        race_ok: bool = True,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """`race_ok=False`: a request whose 4xx no racing erasure can explain (an erasure itself)."""
        gen0, t0 = self.start_request()
        try:
            r = (client or self.http).request(method, path, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=False) from None
        self.last_status = r.status_code
        self.check_time(kind, t0)
        self.check_status(kind, r.status_code, r.text, expect, race_ok)
        return r

    http: httpx.Client

    def openai_call(self, kind: str, fn: Callable[[], Any]) -> Any:
        import openai

        gen0, t0 = self.start_request()
        try:
            out = fn()
        except (openai.APITimeoutError, httpx.TimeoutException) as exc:  # httpx's: inside a stream
            raise self.no_answer(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=False) from None
        except openai.APIConnectionError as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=False) from None
        except openai.APIStatusError as exc:
            self.check_status(kind, exc.status_code, exc.response.text, ())
            raise  # unreachable: check_status raised
        except openai.APIError as exc:  # an error event inside a stream
            raise self._stream_error(kind, gen0, exc.body or repr(exc)) from None
        self.check_time(kind, t0)
        return out

    def stream_request(
        self, kind: str, path: str, body: dict[str, Any], final: Callable[[dict[str, Any]], bool]
    ) -> tuple[str, dict[str, Any]]:
        """POST a streamed request; (the text of its deltas, the last event `final` accepts).
        Chat streams end with `[DONE]`, Responses streams with `response.completed`."""
        gen0, t0 = self.start_request()
        parts: list[str] = []
        fields: dict[str, Any] = {}
        done = False
        try:
            with self.http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self.check_status(kind, resp.status_code, resp.text, (200,))
                for ev in sse(resp):
                    if ev == "[DONE]":
                        done = True
                        break
                    assert isinstance(ev, dict)
                    if "error" in ev or ev.get("type") == "error":
                        raise self._stream_error(kind, gen0, ev.get("error") or ev)
                    if final(ev):
                        fields = ev
                    if ev.get("type") == "response.completed":
                        done = True
                        break
                    if ev.get("type") == "response.output_text.delta":
                        parts.append(str(ev.get("delta") or ""))
                    for ch in ev.get("choices") or []:
                        parts.append((ch.get("delta") or {}).get("content") or "")
        except httpx.TimeoutException as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self.no_answer(kind, gen0, t0, exc, timeout=False) from None
        self.check_time(kind, t0)
        if not done:
            raise self.no_answer(kind, gen0, t0, RuntimeError("stream ended without its end"), timeout=False)
        return "".join(parts), fields


def sse(resp: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """The `data:` payloads of a server-sent event stream (`event:` lines are named in the data)."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def first_divergence(
    ours: list[dict[str, Any]], cold: list[dict[str, Any]]
) -> tuple[int, float, float] | None:
    """Where two greedy token streams (OpenAI `logprobs.content`) first differ, and the log-prob
    margins there: (position, the cold run's preference for its own token over ours, ours' for
    its token over the cold one's); inf where the other token is not among the top log-probs.
    None when one stream is a prefix of the other."""
    for i, (a, b) in enumerate(zip(ours, cold, strict=False)):
        if a["token"] == b["token"]:
            continue

        def margin(row: dict[str, Any], mine: str, other: str) -> float:
            tops = {t["token"]: float(t["logprob"]) for t in row.get("top_logprobs") or []}
            tops.setdefault(mine, float(row["logprob"]))
            return tops[mine] - tops[other] if other in tops else float("inf")

        return i, margin(b, b["token"], a["token"]), margin(a, a["token"], b["token"])
    return None
