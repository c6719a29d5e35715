"""Answers a frontend sends back trimmed still extend the versions that hold them
(`dss.dialogue.echoes`). Before: Open WebUI strips the whitespace around every answer it keeps, so
a turn after an answer that ended in a newline matched no stored version and became a new root
(seen as a flaky `test_open_webui.py` run: `parent_version` None instead of 1)."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from dss.config import Quotas
from dss.dialogue.echoes import as_stored, echoes, recent_versions
from dss.dialogue.lead.policy import LeadPolicy
from dss.dialogue.turns import TurnTarget, chat_target, commit_turn
from dss.dialogue.versions import VersionStore

VOLATILE = LeadPolicy("volatile")


def msg(role: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": text, **extra}


def commit(versions: VersionStore, sid: str, target: TurnTarget, messages: list[dict[str, Any]]) -> int:
    ids = np.arange(4 * len(messages), dtype=np.int32)
    return commit_turn(versions, "ann", target, ids, messages, "fp").version.number


def test_an_answer_sent_back_trimmed_extends_its_version(session_factory: sessionmaker[Session]) -> None:
    versions = VersionStore(session_factory, Quotas())
    sys, q1 = msg("system", "Be brief."), msg("user", "Hi")
    a1 = msg("assistant", "Hello! How can I help?\n")  # as generated
    v1 = commit(versions, "s", chat_target(versions, "ann", "s", [sys, q1], None), [sys, q1, a1])

    sent = [sys, q1, msg("assistant", "Hello! How can I help?"), msg("user", "A joke")]
    target = chat_target(versions, "ann", "s", sent, None)
    assert (target.parent, target.branch, target.echoed) == (v1, "main", 1)
    assert target.dialogue == [sys, q1, a1, sent[3]]  # the answer as the model saw it
    a2 = msg("assistant", " Why did the chicken...")
    assert target.dialogue is not None
    v2 = commit(versions, "s", target, [*target.dialogue, a2])
    assert versions.get_version("ann", "s", v2).messages == [sys, q1, a1, sent[3], a2]

    # Both answers trimmed on the next turn; a regenerate of the last answer extends v2's parent.
    later = [*sent, msg("assistant", "Why did the chicken..."), msg("user", "Another")]
    target = chat_target(versions, "ann", "s", later, None)
    assert (target.parent, target.echoed) == (v2, 2)
    again = chat_target(versions, "ann", "s", sent, None)
    assert (again.parent, again.branch, again.echoed) == (v1, None, 1)  # forks at v1


def test_a_trimmed_answer_under_a_moved_clock_is_a_lead_update(
    session_factory: sessionmaker[Session],
) -> None:
    """What Open WebUI sends with `{{CURRENT_DATETIME}}` in its system prompt."""
    versions = VersionStore(session_factory, Quotas())
    lead, q1 = msg("system", "Now: 2026-12-05 09:14:02"), msg("user", "Hi")
    a1 = msg("assistant", "Hello!\n\n")
    v1 = commit(versions, "s", chat_target(versions, "ann", "s", [lead, q1], None), [lead, q1, a1])
    moved = [msg("system", "Now: 2026-12-05 09:14:40"), q1, msg("assistant", "Hello!"), msg("user", "Time?")]
    target = chat_target(versions, "ann", "s", moved, None, lead_policy=VOLATILE)
    assert (target.parent, target.echoed) == (v1, 1)
    assert target.lead is not None and target.lead.served
    assert target.dialogue == [moved[0], q1, a1, moved[3]]  # the request's lead, the stored answer


def test_only_whitespace_around_an_answer_is_taken_back(session_factory: sessionmaker[Session]) -> None:
    versions = VersionStore(session_factory, Quotas())
    q1, a1 = msg("user", "Hi"), msg("assistant", "Hello there.\n")
    v1 = commit(versions, "s", chat_target(versions, "ann", "s", [q1], None), [q1, a1])
    for edited in (
        msg("assistant", "Hello  there."),  # inside the text: an edit
        msg("assistant", "Hello there!"),
        msg("assistant", "Hello there.", name="bot"),  # another field differs
        msg("user", "Hello there."),
    ):
        target = chat_target(versions, "ann", "s", [q1, edited, msg("user", "Next")], None)
        assert target.dialogue is None and target.echoed == 0, edited
        assert target.parent != v1, edited  # what an edited history always did
    assert echoes(a1, msg("assistant", "  Hello there.  "))
    assert not echoes(a1, a1)  # the same message is not an echo: nothing to take back
    assert not echoes(msg("assistant", None), msg("assistant", ""))  # type: ignore[arg-type]


def test_the_version_agreeing_furthest_wins(session_factory: sessionmaker[Session]) -> None:
    versions = VersionStore(session_factory, Quotas())
    q1, q2, a1, a2 = msg("user", "a"), msg("user", "b"), msg("assistant", "x "), msg("assistant", "y\n")
    v1 = commit(versions, "s", chat_target(versions, "ann", "s", [q1], None), [q1, a1])
    v2 = commit(versions, "s", chat_target(versions, "ann", "s", [q1, a1, q2], None), [q1, a1, q2, a2])
    recent = recent_versions(versions, "ann", versions.get_session("ann", "s"))
    assert [v.number for v in recent] == [v2, v1]  # the head, then its parent
    sent = [q1, msg("assistant", "x"), q2, msg("assistant", "y"), msg("user", "c")]
    got = as_stored(sent, recent)
    assert got is not None and got.echoed == 2 and got.messages == [q1, a1, q2, a2, sent[4]]
    assert as_stored([q1, a1, msg("user", "c")], recent) is None  # nothing echoed: nothing to do
