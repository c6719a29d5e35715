"""Where a hot turn's time goes beyond vLLM's own prefix-cache hit (`model_matrix.py --phases`).

Wraps the public entry points of the store and the connector that a DSS session turn passes
through and sums their wall time over the turns measured. Only an in-process engine (a row with
one rank) runs its scheduler and worker in this process: other rows report the API-side phases
alone. The wrappers cost about a microsecond per call; phases nest nowhere, so they add up to
what DSS adds to a turn (the copy included), less what happens between them (vLLM's own work for
a longer prompt context, the GIL handed between this thread and the store's RPC thread).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def _phases() -> dict[str, tuple[type, str]]:
    from dss.ops.kv.cache import KVCache
    from dss.wire import SessionTag
    from engine_patch.connector.scheduler_side import SchedulerSide
    from engine_patch.connector.worker_side import WorkerSide

    return {
        "plan (store: match, pin)": (KVCache, "plan_ahead"),
        "sign (tag + pickled plan)": (SessionTag, "to_params"),
        "lookup (verify, unpickle, take)": (SchedulerSide, "get_num_new_matched_tokens"),
        "after alloc": (SchedulerSide, "update_state_after_alloc"),
        "step metadata": (SchedulerSide, "build_connector_meta"),
        "worker load (copy, check)": (WorkerSide, "start_load_kv"),
        "worker finished": (WorkerSide, "get_finished"),
        "finished (report)": (SchedulerSide, "request_finished"),
    }


class HotPhases:
    """Sums of each phase's wall time over the turns run inside `turn()`, while `installed()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.turns = 0
        self._on = False
        self._this_turn: dict[str, float] = defaultdict(float)
        # Each turn's time per phase: on a shared 2-core machine one preempted turn can double a
        # phase's mean, so the lines give the median too.
        self.per_turn: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        originals: list[tuple[type, str, Callable[..., Any]]] = []
        try:
            for name, (cls, attr) in _phases().items():
                fn = cls.__dict__[attr]
                originals.append((cls, attr, fn))
                setattr(cls, attr, self._timed(name, fn))
            yield
        finally:
            for cls, attr, fn in originals:
                setattr(cls, attr, fn)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False
            self.turns += 1
            for name, seconds in self._this_turn.items():
                self.per_turn[name].append(seconds)
            self._this_turn.clear()

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                self.seconds[name] += took
                self._this_turn[name] += took

        return timed

    def lines(self) -> list[str]:
        """One line per phase, in ms per turn (mean, then median over the turns; a turn that did
        not pass a phase counts 0 there), and their sums."""
        n = max(1, self.turns)

        def median_ms(name: str) -> float:
            got = self.per_turn.get(name, [])
            return 1000 * float(np.median(got + [0.0] * (self.turns - len(got)))) if self.turns else 0.0

        out = [f"    {1000 * s / n:6.3f} {median_ms(k):6.3f} ms  {k}" for k, s in self.seconds.items()]
        total = 1000 * sum(self.seconds.values()) / n
        medians = sum(median_ms(k) for k in self.seconds)
        turns = f"{self.turns} turns; mean, median"
        out.append(f"    {total:6.3f} {medians:6.3f} ms  in all, per DSS turn ({turns})")
        return out
