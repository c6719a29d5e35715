"""The version store's invariants, checked over its tables (`VersionStore.check`)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from dss.db.models import BranchRow, SessionRow, VersionRow
from dss.dialogue.versions.rules import EMPTY_HEAD, MAIN_BRANCH


def version_store_problems(db: Session) -> list[str]:
    """Every broken invariant of the version store's rows, as readable lines (empty = healthy):
    versions without a session or outside 1..version_count, bad parents, branches without a
    session or pointing at a missing version, sessions without a main branch."""
    problems: list[str] = []
    counts = {
        (u, sid): n
        for u, sid, n in db.execute(
            select(SessionRow.user_id, SessionRow.id, SessionRow.version_count)
        ).tuples()
    }
    parents: dict[tuple[str, str], dict[int, int | None]] = {k: {} for k in counts}
    for u, sid, number, parent in db.execute(
        select(VersionRow.user_id, VersionRow.session_id, VersionRow.number, VersionRow.parent)
    ).tuples():
        if (u, sid) not in parents:
            problems.append(f"version {sid}/{number} has no session")
            continue
        parents[(u, sid)][number] = parent
    for key, count in counts.items():
        sid = key[1]
        numbers = parents[key]
        # A subset of 1..count: deleted subtrees leave gaps, numbers are never reused.
        if numbers and (min(numbers) < 1 or max(numbers) > count):
            problems.append(f"session {sid}: versions {sorted(numbers)} outside 1..{count}")
        for number, parent in numbers.items():
            if parent is not None and (parent >= number or parent not in numbers):
                problems.append(f"session {sid}: version {number} has bad parent {parent}")
    has_main = set()
    for u, sid, name, head in db.execute(
        select(BranchRow.user_id, BranchRow.session_id, BranchRow.name, BranchRow.head_version)
    ).tuples():
        if (u, sid) not in counts:
            problems.append(f"branch {sid}/{name} has no session")
            continue
        if name == MAIN_BRANCH:
            has_main.add((u, sid))
        if head != EMPTY_HEAD and head not in parents[(u, sid)]:
            problems.append(f"branch {sid}/{name} points at missing version {head}")
    for key in counts.keys() - has_main:
        problems.append(f"session {key[1]} has no {MAIN_BRANCH!r} branch")
    return problems
