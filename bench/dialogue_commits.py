"""What durable commits cost, and how a turn's dialogue work grows with the session's length.

Side by side on one machine, in one run, on SQLite files in a temporary folder:
- commits with `synchronous=FULL` (what the store runs: a committed version survives a power
  loss) and with `synchronous=NORMAL` (the WAL is synced only at checkpoints), through the real
  `VersionStore`, one chat turn (user + assistant message) per commit;
- the turn-time dialogue work (`find_deepest_prefix_version` + `commit`) at turn 10 and at the
  last turn, and the bytes stored per version: with messages stored once, neither grows with
  the square of the turn count;
- a commit for a user who already holds `--user-versions` versions (default 50,000; the quota
  check counts them and sums their bytes: an index covers it since migration 0015).

Run: .venv/bin/python bench/dialogue_commits.py [--turns 200] [--user-versions 50000]
Ends with: RESULT commit_ms_full= commit_ms_normal= full_vs_normal= turn_ms_early= turn_ms_late=
late_vs_early= bytes_per_version= commit_ms_many_versions= many_vs_full=
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event, func, insert, select

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, transaction, upgrade_to_head
from dss.db.models import VersionRow, utcnow
from dss.dialogue.versions import VersionStore

USER = "bench-user"


def _run(folder: Path, synchronous: str, turns: int) -> dict[str, Any]:
    url = sqlite_url_for(folder)
    upgrade_to_head(url)
    engine = make_engine(url)

    @event.listens_for(engine, "connect")
    def _mode(dbapi_conn: Any, _record: Any) -> None:  # runs after the store's own pragmas
        dbapi_conn.execute(f"PRAGMA synchronous={synchronous}")

    vs = VersionStore(make_session_factory(engine))
    vs.create_session(USER, "s")
    history: list[dict[str, str]] = []
    commit_ms: list[float] = []
    turn_ms: list[float] = []
    for i in range(turns):
        question = {"role": "user", "content": f"question {i}: " + "lorem ipsum dolor sit amet " * 8}
        answer = {"role": "assistant", "content": f"answer {i}: " + "consectetur adipiscing elit " * 20}
        t0 = time.perf_counter()
        found = vs.find_deepest_prefix_version(USER, "s", [*history, question])
        t1 = time.perf_counter()
        history = [*history, question, answer]
        parent = found.number if found else 0
        vs.commit(USER, "s", tokens=list(range(200 * (i + 1))), messages=history, parent=parent)
        t2 = time.perf_counter()
        commit_ms.append((t2 - t1) * 1e3)
        turn_ms.append((t2 - t0) * 1e3)
    with transaction(make_session_factory(engine)) as db:
        body = db.scalar(select(func.sum(VersionRow.body_bytes))) or 0
        tokens = db.scalar(select(func.sum(func.length(VersionRow.tokens)))) or 0
    engine.dispose()
    return {
        "commit_ms": statistics.median(commit_ms),
        "turn_ms_early": statistics.median(turn_ms[5:15]),
        "turn_ms_late": statistics.median(turn_ms[-10:]),
        "message_bytes_per_version": (body - tokens) / turns,
    }


def _commit_ms_with_many(folder: Path, held: int) -> float:
    """The median commit of a user who holds `held` versions already (bulk-inserted in another
    session of theirs)."""
    url = sqlite_url_for(folder)
    upgrade_to_head(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    vs = VersionStore(factory)
    vs.create_session(USER, "held")
    now = utcnow()
    row = {"session_id": "held", "branch": "main", "created_at": now, "n_tokens": 100, "tokens": b"\0" * 400}
    for start in range(0, held, 5000):
        numbers = range(start + 1, min(held, start + 5000) + 1)
        with transaction(factory) as db:
            db.execute(
                insert(VersionRow),
                [
                    {**row, "user_id": USER, "number": n, "parent": n - 1 or None, "messages": [],
                     "messages_base": n - 1, "n_messages": n, "digest": f"d{n}", "body_bytes": 500}
                    for n in numbers
                ],
            )  # fmt: skip
    vs.create_session(USER, "s")
    history: list[dict[str, str]] = []
    commit_ms: list[float] = []
    for i in range(20):
        history = [*history, {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        t0 = time.perf_counter()
        vs.commit(USER, "s", tokens=list(range(200 * (i + 1))), messages=history)
        commit_ms.append((time.perf_counter() - t0) * 1e3)
    engine.dispose()
    return statistics.median(commit_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--user-versions", type=int, default=50_000)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = parser.parse_args()
    if args.smoke:
        args.turns = 30  # past turn 15: the "early" window is turns 5-15
        args.user_versions = 2000
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:  # a real disk, not tmpfs
        full = _run(Path(tmp) / "full", "FULL", args.turns)
        normal = _run(Path(tmp) / "normal", "NORMAL", args.turns)
        many = _commit_ms_with_many(Path(tmp) / "many", args.user_versions)
    print(f"commit p50: FULL {full['commit_ms']:.2f} ms, NORMAL {normal['commit_ms']:.2f} ms")
    early, late = full["turn_ms_early"], full["turn_ms_late"]
    print(f"turn dialogue work p50: turns 5-15 {early:.2f} ms, last 10 {late:.2f} ms")
    print(f"message bytes stored per version: {full['message_bytes_per_version']:.0f}")
    print(f"commit p50 of a user holding {args.user_versions} versions: {many:.2f} ms")
    print(
        f"RESULT commit_ms_full={full['commit_ms']:.3f} commit_ms_normal={normal['commit_ms']:.3f} "
        f"full_vs_normal={full['commit_ms'] / normal['commit_ms']:.3f} "
        f"turn_ms_early={full['turn_ms_early']:.3f} turn_ms_late={full['turn_ms_late']:.3f} "
        f"late_vs_early={full['turn_ms_late'] / full['turn_ms_early']:.3f} "
        f"bytes_per_version={full['message_bytes_per_version']:.0f} "
        f"commit_ms_many_versions={many:.3f} many_vs_full={many / full['commit_ms']:.3f}"
    )


if __name__ == "__main__":
    main()
