"""Lead updates in the store (issue 27): which system-prompt differences are volatile values, what
the update says, what the model saw, and where a drifted dialogue attaches (SQLite, PostgreSQL)."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dss.config import Quotas
from dss.db.models import VersionRow
from dss.dialogue.lead.gate import Check, QualityGate, total_variation
from dss.dialogue.lead.policy import GATED, NOT_TEXT, NOT_VOLATILE, OFF, LeadPolicy, classify
from dss.dialogue.lead.update import noted, update_text
from dss.dialogue.lead.view import ModelView
from dss.dialogue.lead.volatile import Recogniser
from dss.dialogue.turns import chat_target, commit_turn
from dss.dialogue.versions import VersionStore
from dss.errors import InvalidInput

VOLATILE = LeadPolicy("volatile")


def sys(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # Open WebUI: {{CURRENT_DATETIME}}, {{CURRENT_DATE}}, {{CURRENT_TIME}}, {{CURRENT_WEEKDAY}}
        ("Now: 2026-12-05 09:14:02.", "Now: 2026-12-05 09:14:49."),
        ("Date 2026-12-05, time 09:14:02 AM, Saturday.", "Date 2026-12-06, time 01:00:00 PM, Sunday."),
        # LibreChat: {{iso_datetime}}, {{current_date}}
        ("It is 2026-12-05T09:14:02.123Z.", "It is 2026-12-05T09:15:00.001Z."),
        # AnythingLLM's {datetime} in an en-US locale
        ("The time is 12/5/2026, 9:14:02 AM.", "The time is 12/5/2026, 9:15:02 AM."),
        ("Today is December 5, 2026 at 9:14.", "Today is December 6, 2026 at 10:02."),
        ("Heute ist der 05.12.2026.", "Heute ist der 06.12.2026."),
        ("Today is 5 December 2026.", "Today is 6 December 2026."),
    ],
)
def test_dates_and_times_the_frontends_write_are_volatile(old: str, new: str) -> None:
    drift = classify(VOLATILE, sys(old), sys(new))
    assert drift.served and drift.change is not None and drift.change.kind == "volatile"
    assert all(v.old != v.new for v in drift.change.values) and drift.change.values


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("You are a helpful assistant.", "You are a pirate."),
        ("Now: 2026-12-05 09:14:02.", "Now: 2026-12-05 09:14:49. Be brief."),  # a value and more
        ("The user's name is Ann.", "The user's name is Bob."),  # a name is not built in
        ("Answer in 3 sentences.", "Answer in 4 sentences."),  # a number is not a date
    ],
)
def test_other_edits_are_not_volatile(old: str, new: str) -> None:
    drift = classify(VOLATILE, sys(old), sys(new))
    assert (drift.served, drift.reason) == (False, NOT_VOLATILE)
    assert drift.change is not None and drift.change.kind == "prompt"
    assert classify(LeadPolicy("any"), sys(old), sys(new)).served  # mode any serves it


def test_operator_patterns_name_a_frontends_own_values() -> None:
    policy = LeadPolicy("volatile", (r"(?<=The user's name is )\w+", r"(?s)<memories>.*?</memories>"))
    old = sys("The user's name is Ann.\n<memories>likes tea</memories>\nBe kind.")
    new = sys("The user's name is Bob.\n<memories>likes tea\nhas a cat</memories>\nBe kind.")
    drift = classify(policy, old, new)
    assert drift.served and drift.change is not None
    assert [(v.old, v.new) for v in drift.change.values] == [
        ("Ann", "Bob"),
        ("<memories>likes tea</memories>", "<memories>likes tea\nhas a cat</memories>"),
    ]


def test_off_gated_and_non_text_leads_say_why() -> None:
    old, new = sys("Now: 09:14:02"), sys("Now: 09:14:49")
    assert classify(LeadPolicy("off"), old, new).reason == OFF
    assert classify(LeadPolicy("volatile", gated=True), old, new).reason == GATED
    image = {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert classify(VOLATILE, image, new).reason == NOT_TEXT


@pytest.mark.parametrize("bad", ["", "(", "x*", "a" * 600])
def test_bad_operator_patterns_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInput):
        Recogniser([bad])
    with pytest.raises(InvalidInput):
        LeadPolicy("sometimes")  # type: ignore[arg-type]


def test_the_update_states_the_lines_that_changed_as_they_read_now() -> None:
    old = "You are helpful.\nCurrent date and time: 2026-12-05 09:14:02\nThe user is Ann."
    new = "You are helpful.\nCurrent date and time: 2026-12-05 09:14:49\nThe user is Ann."
    change = classify(VOLATILE, sys(old), sys(new)).change
    assert change is not None
    assert update_text(change) == "Current date and time: 2026-12-05 09:14:49"
    assert noted({"role": "user", "content": "Hi"}, "T")["content"] == "(T)\n\nHi"  # type: ignore[index]
    persona = classify(LeadPolicy("any"), sys("A"), sys("B")).change
    assert persona is not None and update_text(persona) == "B"


def test_the_model_view_replays_what_the_model_saw() -> None:
    client = [sys("new"), {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    view = ModelView().replacing(0, sys("old")).inserting(1, sys("update"))
    assert view.seen(client) == [sys("old"), sys("update"), *client[1:]]
    assert ModelView.of(view.record()) == view and ModelView().record() is None
    later = [*client, {"role": "user", "content": "q2"}]
    assert view.seen(later)[-1] == later[-1]  # later messages are seen as sent


def test_the_gate_trips_on_low_agreement_and_rearms() -> None:
    gate = QualityGate(window=4, min_checks=3, min_agreement=0.5)
    assert not gate.record("webui", Check(True, True, 0.1))
    assert not gate.record("webui", Check(False, False, 0.5))
    assert gate.record("webui", Check(False, False, 0.5))  # 1 of 3 agree: below 0.5
    assert gate.tripped("webui") and not gate.tripped("other")
    assert not gate.record("webui", Check(False, False, 0.5))  # trips once
    (fig,) = gate.figures()
    assert fig.tripped and fig.checks == 4 and fig.first_token_agreement == 0.25
    assert gate.reset("webui") and not gate.tripped("webui")
    assert total_variation({1: 0.9}, {1: 0.9}) == 0.0 and total_variation({1: 1.0}, {2: 1.0}) == 1.0


def test_a_drifted_dialogue_attaches_to_the_version_it_extends(
    session_factory: sessionmaker[Session],
) -> None:
    """Before: every turn whose time moved became a root version on a new fork-root branch."""
    versions = VersionStore(session_factory, Quotas())
    history: list[dict[str, str]] = []
    numbers = []
    for i in range(3):
        history.append({"role": "user", "content": f"q{i}"})
        lead = sys(f"Now: 2026-12-05 09:14:{10 + i:02d}")
        target = chat_target(versions, "ann", "s", [lead, *history], None, lead_policy=VOLATILE)
        assert (target.parent, target.branch) == ((numbers[-1], "main") if numbers else (None, "main"))
        if numbers:
            assert target.lead is not None and target.lead.served and target.base is not None
        answer = {"role": "assistant", "content": f"a{i}"}
        done = commit_turn(
            versions, "ann", target, np.arange(5 * (i + 1), dtype=np.int32), [lead, *history, answer], "fp"
        )
        numbers.append(done.version.number)
        history.append(answer)
    assert [b.name for b in versions.get_session("ann", "s").branches] == ["main"]
    # Off, it still attaches (the tree stays the conversation's) and says why it renders whole.
    history.append({"role": "user", "content": "q3"})
    off = chat_target(versions, "ann", "s", [sys("Now: 2026-12-05 10:00:00"), *history], None)
    assert off.parent == numbers[-1] and off.lead is not None and off.lead.reason == OFF
    # A regenerate (the last answer again, with a newer time) attaches to the head's parent.
    again = chat_target(
        versions, "ann", "s", [sys("Now: 2026-12-05 11:00:00"), *history[:-2]], None, lead_policy=VOLATILE
    )
    assert again.parent == numbers[-2] and again.lead is not None and again.lead.served


def test_a_chat_whose_lead_moves_every_turn_stores_its_messages_once(
    session_factory: sessionmaker[Session],
) -> None:
    """Each version whose system prompt alone changed stores that prompt and its own new messages,
    not the whole list again (before: the whole list each turn, O(n^2) bytes)."""
    versions = VersionStore(session_factory, Quotas())
    history: list[dict[str, str]] = []
    for i in range(6):
        history.append({"role": "user", "content": f"question {i} " + "x" * 200})
        lead = sys(f"Now: 2026-12-05 09:14:{10 + i:02d}")
        target = chat_target(versions, "ann", "grow", [lead, *history], None, lead_policy=VOLATILE)
        answer = {"role": "assistant", "content": f"answer {i} " + "y" * 200}
        done = commit_turn(
            versions, "ann", target, np.arange(3, dtype=np.int32), [lead, *history, answer], "fp"
        )
        history.append(answer)
        assert versions.get_version("ann", "grow", done.version.number).messages == [lead, *history]
    listed = versions.list_versions("ann", "grow", with_body=True)
    assert listed[-1].messages == [lead, *history]
    with session_factory() as db:
        sizes = [len(str(r.messages)) for r in db.scalars(select(VersionRow).order_by(VersionRow.number))]
    assert max(sizes[1:]) < 2 * sizes[0], sizes  # each later row: its two messages, not all of them
