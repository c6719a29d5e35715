"""The soak's own bookkeeping (`bench/soak.py`, code in `bench/_soak/`), without a server: which
acknowledged versions an erasure racing the traffic may take, which 4xx answers are the erasure
winning, and when an answer differs from a cold recompute by more than rounding. The soak's
verdicts rest on these."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.paths import BENCH

sys.path.insert(0, str(BENCH))
from _soak.calls import Ambiguous, Gate, first_divergence
from _soak.client import Client
from _soak.erasures import ErasureLog
from _soak.model import Entry
from _soak.turns import CORRUPT_MARGIN


def tok(token: str, tops: dict[str, float]) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": tops[token],
        "top_logprobs": [{"token": t, "logprob": lp} for t, lp in tops.items()],
    }


def test_first_divergence_margins() -> None:
    same = [tok("a", {"a": -0.1, "b": -2.0})]
    assert first_divergence(same, same) is None
    # A near tie flipped by rounding: both sides barely prefer their own token.
    ours = [*same, tok("x", {"x": -0.70, "y": -0.72})]
    cold = [*same, tok("y", {"y": -0.69, "x": -0.71})]
    pos, cold_margin, our_margin = first_divergence(ours, cold) or (0, 0.0, 0.0)
    assert pos == 1 and cold_margin == pytest.approx(0.02) and our_margin == pytest.approx(0.02)
    assert cold_margin < CORRUPT_MARGIN
    # The served token is not even among the cold run's top tokens: no rounding does that.
    far = [*same, tok("z", {"z": -0.01})]
    assert first_divergence(far, cold) == (1, float("inf"), float("inf"))


@dataclass
class FakeRec:
    counts: Counter[str] = field(default_factory=Counter)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def event(self, kind: str, keep: int = 20, **info: Any) -> None:
        self.events.append((kind, info))


class FakeCtl:
    """The part of the soak's `Controller` a client's erasure bookkeeping uses, with the run's
    real `ErasureLog`."""

    def __init__(self) -> None:
        self.gate = Gate()
        self.rec = FakeRec()
        self.deadline_s = 5.0
        self.erasures = ErasureLog(self.rec)  # type: ignore[arg-type]
        self.admin_key = self.replay_key = "k"
        self.server = type("S", (), {"base_url": "http://127.0.0.1:9"})()


def client(ctl: FakeCtl) -> Client:
    return Client(0, "u", "key", ctl, 1)  # type: ignore[arg-type]


def ack(c: Client, sid: str, n: int, q: float) -> Entry | None:
    s = c.sessions.get(sid) or c.new_session(stored=False)
    c.sessions[sid] = s
    s.sid = sid
    data = {"state_version": n, "parent_version": None, "branch": "main", "session_id": sid}
    return c.acked(s, data, [{"role": "user", "content": f"{sid}:{n}"}], "chat", 0, q)


def test_an_erasure_takes_what_was_sent_before_it_ended_and_keeps_what_came_after() -> None:
    ctl = FakeCtl()
    c = client(ctl)
    t0 = time.monotonic()
    c.start_request()
    assert ack(c, "s-old", 1, t0) is not None
    er = ctl.erasures.begin("u", "admin")
    assert c.raced()  # an erasure this client has not caught up with
    # Acknowledged while it ran: never in the ledger (its fate is the erasure's).
    assert ack(c, "s-mid", 1, t0 + 0.001) is None
    assert ctl.rec.counts["acked_during_erasure"] == 1
    ctl.erasures.end(er, {"id": "era_1", "verification": {"remnants": 0, "chain_ok": True}})
    c.own_erasure.catch_up()
    c.start_request()  # the next request: sent with the erasure caught up with
    assert not c.raced()
    assert list(c.ledger) == [] and "s-old" not in c.sessions
    assert ctl.rec.counts["erased_versions"] == 1
    # Sent after the erasure ended: it must stay, and is not exempt when it is lost.
    late = ack(c, "s-new", 1, time.monotonic())
    assert late is not None and list(c.ledger) == [("s-new", 1)]
    assert not ctl.erasures.erased_since("u", late.q)
    assert ctl.erasures.all_receipts() == [("u", "era_1")]


def test_a_refused_erasure_erases_nothing_and_a_hung_one_may_erase_anything() -> None:
    ctl = FakeCtl()
    c = client(ctl)
    c.start_request()
    e = ack(c, "s", 1, time.monotonic())
    assert e is not None
    void = ctl.erasures.begin("u", "self")
    ctl.erasures.end(void, None, void=True)  # e.g. 404 "no such endpoint"
    c.own_erasure.catch_up()
    assert list(c.ledger) == [("s", 1)] and not ctl.erasures.erased_since("u", e.q)
    hung = ctl.erasures.begin("u", "admin")
    ctl.erasures.end(hung, None, unknown=True)
    assert ctl.erasures.erased_since("u", time.monotonic())  # it may still commit: nothing is provably lost


def test_a_4xx_is_the_erasure_winning_only_when_one_raced_the_request() -> None:
    ctl = FakeCtl()
    c = client(ctl)
    c.start_request()
    with pytest.raises(Ambiguous):
        c.check_status("chat", 404, "{}", (200,))
    assert ctl.rec.counts["unexpected"] == 1 and ctl.rec.counts["erased_4xx"] == 0
    c.start_request()
    ctl.erasures.begin("u", "admin")
    with pytest.raises(Ambiguous):
        c.check_status("chat", 409, "{}", (200,))
    assert ctl.rec.counts["erased_4xx"] == 1
    with pytest.raises(Ambiguous):  # an erasure's own 404 is never explained by a race
        c.check_status("erase", 404, "{}", (200,), race_ok=False)
    assert ctl.rec.counts["unexpected"] == 2
    with pytest.raises(Ambiguous):  # nor is a 5xx
        c.check_status("chat", 500, "{}", (200,))
    assert ctl.rec.counts["errors_5xx"] == 1
