"""The quality gate of lead updates: rolling figures per frontend, and the decision to stop.

A sample of the turns served as lead updates is checked off the critical path (by the API, when
the engine has room): the answer's first tokens are computed greedily twice, from the prompt as
served (the stored history, then the update) and from the exact prompt (the whole dialogue
rendered with the new lead), and compared. `record` keeps the last `window` checks of each
frontend: the share whose first token agrees, the share whose first `k` tokens all agree, and
the mean total-variation distance of the first token's distributions. When, over at least
`min_checks` checks, the first-token agreement falls below `min_agreement` (or the mean distance
rises above `max_distance`), the frontend's lead
updates stop (`tripped`) until an operator re-arms them (`reset`): the figures say so in
`/metrics` and the admin API, and the API logs it once.

Per server, in memory: a restarted server starts with fresh figures (and lead updates on again).
The lock is a leaf: nothing is called under it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Check:
    first_agrees: bool
    all_agree: bool  # the first k tokens
    distance: float  # total variation of the first token's distributions, in [0, 1]


@dataclass(frozen=True, slots=True)
class Figures:
    frontend: str
    checks: int
    first_token_agreement: float | None
    prefix_agreement: float | None
    mean_distance: float | None
    tripped: bool


class QualityGate:
    def __init__(self, window: int, min_checks: int, min_agreement: float, max_distance: float = 1.0) -> None:
        self.window = window
        self.min_checks = min_checks
        self.min_agreement = min_agreement
        self.max_distance = max_distance
        self._lock = threading.Lock()
        self._checks: dict[str, deque[Check]] = {}
        self._tripped: set[str] = set()

    def record(self, frontend: str, check: Check) -> bool:
        """Count one check; True when it trips the gate for `frontend` (only on that check)."""
        with self._lock:
            checks = self._checks.setdefault(frontend, deque(maxlen=self.window))
            checks.append(check)
            if frontend in self._tripped or len(checks) < self.min_checks:
                return False
            agreement = sum(c.first_agrees for c in checks) / len(checks)
            distance = sum(c.distance for c in checks) / len(checks)
            if agreement >= self.min_agreement and distance <= self.max_distance:
                return False
            self._tripped.add(frontend)
            return True

    def tripped(self, frontend: str) -> bool:
        with self._lock:
            return frontend in self._tripped

    def reset(self, frontend: str) -> bool:
        """Re-arm `frontend`'s lead updates with fresh figures; whether it was tripped."""
        with self._lock:
            self._checks.pop(frontend, None)
            was = frontend in self._tripped
            self._tripped.discard(frontend)
            return was

    def figures(self) -> list[Figures]:
        with self._lock:
            snapshot = {f: list(c) for f, c in self._checks.items()}
            tripped = set(self._tripped)
        return [_figures(f, checks, f in tripped) for f, checks in sorted(snapshot.items())]


def _figures(frontend: str, checks: list[Check], tripped: bool) -> Figures:
    n = len(checks)
    if n == 0:
        return Figures(frontend, 0, None, None, None, tripped)
    return Figures(
        frontend,
        n,
        sum(c.first_agrees for c in checks) / n,
        sum(c.all_agree for c in checks) / n,
        sum(c.distance for c in checks) / n,
        tripped,
    )


def total_variation(p: dict[int, float], q: dict[int, float]) -> float:
    """Half the L1 distance of two first-token distributions given as their top entries
    (probabilities); the mass neither lists counts as one remainder bucket each."""
    keys = set(p) | set(q)
    listed = sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)
    rest = abs((1.0 - sum(p.values())) - (1.0 - sum(q.values())))
    return min(1.0, 0.5 * (listed + rest))
