"""Where `truncation: "auto"` cuts a dialogue (issue 27, item 4a): in one large step, at a user
message, keeping the lead and at most half the room, so later turns extend the same prefix."""

from __future__ import annotations

from dss.dialogue.lead.view import ModelView
from dss.dialogue.truncation import cut_points

ROLES = ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]


def test_the_cut_keeps_the_lead_and_the_newest_turns_within_half_the_room() -> None:
    sizes = [50, 100, 100, 100, 100, 100, 100, 100]  # 750 in all
    points = cut_points(ROLES, sizes, True, room=700)  # fits 350: lead + the last 3 messages
    assert points[0] == 5 and points == [5, 7]
    assert cut_points(ROLES, sizes, True, room=100) == [7]  # only the newest user turn is left
    assert cut_points(["system", "user"], [10, 10], True, room=5) == []  # nothing to drop


def test_the_cut_stays_put_while_the_shortened_dialogue_grows() -> None:
    """A turn after the cut extends it: the cut is taken again only once the kept part
    outgrows the room (half a context of turns later), not on every turn."""
    sizes = [50, *[100] * 7]
    first = cut_points(ROLES, sizes, True, room=700)[0]
    kept = 50 + sum(sizes[first:])
    grown = kept + 2 * 100
    assert grown <= 700  # the next turn still fits: no new cut, the same prefix from cache


def test_a_view_with_dropped_messages_shows_the_model_the_rest() -> None:
    msgs = [{"role": r, "content": str(i)} for i, r in enumerate(ROLES)]
    view = ModelView(dropped=(1, 5))
    assert [m["content"] for m in view.seen(msgs)] == ["0", "5", "6", "7"]
    assert ModelView.of(view.record()) == view
