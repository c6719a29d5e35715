"""`bench/_hot_phases.py` (`model_matrix.py --hot-only --phases`) times the phases of the turns
run inside `turn()` only, and puts the wrapped functions back when it is done."""

from __future__ import annotations

import importlib
import sys

from dss.types import SessionId, TenantId
from dss.wire import SessionTag, tag_key
from tests.paths import BENCH


def test_only_the_turns_measured_are_timed_and_the_originals_come_back() -> None:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    phases = importlib.import_module("_hot_phases").HotPhases()
    original = SessionTag.__dict__["to_params"]
    tag, key = SessionTag(TenantId("t"), SessionId("s")), tag_key(b"k" * 32)
    with phases.installed():
        assert SessionTag.__dict__["to_params"] is not original
        tag.to_params(key)  # outside a turn: not counted
        assert not phases.seconds
        with phases.turn():
            assert tag.to_params(key) == original(tag, key)
    assert SessionTag.__dict__["to_params"] is original
    assert phases.turns == 1 and set(phases.seconds) == {"sign (tag + pickled plan)"}
    assert phases.lines()[-1].endswith("in all, per DSS turn (1 turns; mean, median)")
    assert phases.per_turn["sign (tag + pickled plan)"] == [phases.seconds["sign (tag + pickled plan)"]]
