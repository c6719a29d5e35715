"""`VersionStore`: the one name the rest of DSS uses for versioned sessions, made of pieces that
each own one job over the same state (`VersionTables`: session factory, quotas, JSON limits,
write fence).

A session owns numbered versions (1, 2, 3, ... per session) that form a tree through `parent`,
and named branches whose `head_version` points into that tree (0 = the branch has no versions).
A commit appends a child of a branch head; a rollback moves a head back to one of its ancestors
(later versions stay stored); a branch is a new name pointing at any existing version.

Every method takes the acting user and sees only that user's sessions: another user's session
raises `SessionNotFound`, exactly like a missing one. Every transaction that writes a user's rows
holds the user's write fence first (`VersionTables.hold_user`).

Each piece is a base class, so every method is declared on the class that owns its rows
(`help(VersionStore)` and go-to-definition find it) and a call from one method to another goes
through the instance (patching an instance attribute catches it):

| piece | module | its job |
| --- | --- | --- |
| `SessionCatalog` | `sessions` | create, get, ensure, list, delete sessions; metadata, retention hints |
| `VersionWrites` | `writes` | commit a version (quotas, the compare-and-sets, retries); delete a subtree |
| `Branches` | `branches` | branch at a version, roll a head back, read branches |
| `VersionReads` | `reads` | read versions (one, all, a page, the deepest prefix), token ids, subtrees |
| `VersionTables` | `shared` | the shared state, the write fence (`hold_user`), the session lock |
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from dss.db.connect import transaction
from dss.db.models import BranchRow, SessionRow, VersionRow
from dss.dialogue.versions.branches import Branches
from dss.dialogue.versions.reads import VersionReads
from dss.dialogue.versions.rules import EMPTY_HEAD, MAIN_BRANCH
from dss.dialogue.versions.sessions import SessionCatalog
from dss.dialogue.versions.writes import VersionWrites


class VersionStore(SessionCatalog, VersionWrites, Branches, VersionReads):
    """Sessions, branches and versions of every user, over a SQLAlchemy session factory
    (`VersionTables.__init__`: `session_factory`, `quotas`, `json_limits`, `fence`).

    Every row is keyed by its owner first: `(user_id, session_id, ...)`. A query never names a
    session without its user, so one user's ids say nothing about another's.
    """

    def check(self) -> list[str]:
        """Every broken invariant of the version store, as readable lines (empty = healthy)."""
        with transaction(self._factory) as db:
            return version_store_problems(db)


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
