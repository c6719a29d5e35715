"""Route keys in the ids DSS mints (`dss.dialogue.route_keys`): a minted id begins with the route
key it was given (a random one without), keeps the shape ids always had, and gives its key back;
ids of any other shape, and ids minted before route keys, stay what they were."""

from __future__ import annotations

import re

from dss.dialogue.conversations import new_conversation_id
from dss.dialogue.response_store import new_response_id
from dss.dialogue.route_keys import checked_route_key, route_key_for, route_key_of

KEY = "0123456789abcdef"


def test_minted_ids_begin_with_their_route_key_and_keep_their_shape() -> None:
    rid, cid = new_response_id(KEY), new_conversation_id(KEY)
    assert re.fullmatch(rf"resp_{KEY}[0-9a-f]{{32}}", rid) and re.fullmatch(rf"conv_{KEY}[0-9a-f]{{32}}", cid)
    assert route_key_of(rid) == route_key_of(cid) == KEY
    assert len({new_response_id(KEY) for _ in range(100)}) == 100  # the rest is random
    # No key, or not a key: a random one, the same shape.
    for bad in (None, "0123456789ABCDEF", "0123", KEY + "0"):
        made = new_response_id(bad)
        assert re.fullmatch(r"resp_[0-9a-f]{48}", made) and route_key_of(made) != KEY


def test_route_key_of_reads_minted_ids_only() -> None:
    assert route_key_of(f"resp-{KEY}00112233") == KEY  # a response chain's session
    for other in ("chat-1", f"sess_{KEY}", "resp_0123", f"resp_{KEY.upper()}", None, 7):
        assert route_key_of(other) is None
    assert checked_route_key(KEY) == KEY and checked_route_key(KEY[:-1]) is None


def test_route_key_for_takes_the_first_candidate_that_has_one() -> None:
    other = "fedcba9876543210"
    assert route_key_for(None, f"conv_{KEY}{'0' * 32}", other) == KEY
    assert route_key_for(None, None, other) == other
    assert re.fullmatch(r"[0-9a-f]{16}", route_key_for(None, "chat-1", "nope"))
