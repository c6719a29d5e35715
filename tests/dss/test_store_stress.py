"""Concurrency stress of the Store facade: puts, loads and user erasure from many threads at once.

Tiny tiers (16 host pages, ~24 disk pages, fsync on) make host demotion, disk eviction and the
write-through backlog happen all the time, so every lock-order path between the store, the page
table and the background disk writer is exercised. The logic lives in `tests.store_helpers.run_stress`
(shared with bench/store_concurrency.py); this test asserts on its report:

- no hang: some operation completes at least every WATCHDOG_S seconds, and every worker stops when
  asked (a hang fails with every thread's stack);
- no exception at all from put_sequence / load_sequence / erase_user: with 4 workers holding at most
  3 pages each, a 16-page host tier always has evictable room, so even CapacityError is a bug;
- every loaded page is the bytes saved for those tokens by that user, from a generation that was
  live while the load ran: after erase_user(u) returns, no load may return u's pre-erase bytes
  (see run_stress for the exact rule and why it is race-free);
- store.check() passes and store.close() returns afterwards.

Env: DSS_STRESS_SECONDS (default 20), DSS_STRESS_WATCHDOG_S (default 20).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.store_helpers import call_bounded, exit_hard_at_shutdown, open_stress_store, run_stress

STRESS_SECONDS = float(os.environ.get("DSS_STRESS_SECONDS", "20"))
WATCHDOG_S = float(os.environ.get("DSS_STRESS_WATCHDOG_S", "20"))
CLOSE_TIMEOUT_S = 30.0


def _bounded(fn: object, what: str) -> None:
    assert callable(fn)
    finished, _, exc = call_bounded(fn, CLOSE_TIMEOUT_S)
    if not finished:
        exit_hard_at_shutdown()  # the stuck thread would block interpreter exit
        pytest.fail(f"{what} hung after the stress run", pytrace=False)
    if exc is not None:
        raise exc


@pytest.mark.slow
@pytest.mark.timeout(int(STRESS_SECONDS + 2 * WATCHDOG_S + 2 * CLOSE_TIMEOUT_S + 30))
def test_concurrent_put_load_erase_never_hangs_nor_leaks(tmp_path: Path) -> None:
    store = open_stress_store(tmp_path)
    report = run_stress(store, seconds=STRESS_SECONDS, watchdog_s=WATCHDOG_S)
    summary = f"{report.ops} ops ({report.erases} erasures) in {STRESS_SECONDS:.0f} s"
    if report.hung:
        exit_hard_at_shutdown()  # deadlocked store threads would block interpreter exit
        pytest.fail(
            f"hang: the last of {summary} completed {report.last_op_s:.1f} s into the run; nothing "
            f"completed for {WATCHDOG_S:.0f} s after it (detected at {report.hang_after_s:.1f} s); "
            f"thread stacks:\n{report.stacks}",
            pytrace=False,
        )
    problems = [f"{n} x {kind}" for kind, n in report.error_kinds.most_common()]
    problems += report.mismatches[:20]
    if problems:
        pytest.fail(
            f"{sum(report.error_kinds.values())} unexpected exception(s) and {len(report.mismatches)} "
            f"wrong page(s) loaded, in {summary}:\n"
            + "\n".join(problems)
            + "\n\nfirst tracebacks:\n"
            + "\n".join(report.errors[:3]),
            pytrace=False,
        )
    assert report.ops > 0 and report.erases > 0, summary
    _bounded(store.check, "store.check()")
    _bounded(store.close, "store.close()")
