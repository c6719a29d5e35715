"""`VersionStore`: the one name the rest of DSS uses for versioned sessions, composed of pieces
that each own one job over the same session factory, quotas and write fence.

A session owns numbered versions (1, 2, 3, ... per session) that form a tree through `parent`,
and named branches whose `head_version` points into that tree (0 = the branch has no versions).
A commit appends a child of a branch head; a rollback moves a head back to one of its ancestors
(later versions stay stored); a branch is a new name pointing at any existing version.

Every method takes the acting user and sees only that user's sessions: another user's session
raises `SessionNotFound`, exactly like a missing one. Every transaction that writes a user's rows
holds the user's write fence first (`UserFence.hold_user`).

The facade has no logic of its own: each public name is the bound method of the piece that owns
it, so a signature (its defaults, its overloads) and its docstring live in one place:

| piece | module | its job |
| --- | --- | --- |
| `SessionCatalog` | `sessions` | create, get, ensure, list sessions; retention hints |
| `Commits` | `commits` | commit a version: quotas, the compare-and-sets, retries |
| `Branches` | `branches` | branch at a version, roll a head back, read branches |
| `VersionReads` | `reads` | read versions (one, all, a page, the deepest prefix) |
| `TokenReads` | `tokens` | read versions' token ids, a chunk at a time |
| `VersionTree` | `tree` | ancestors, lineage, subtree |
| `Deletions` | `deletion` | delete a session, a subtree, a user's sessions; hold a session |
| `UserFence` | `fence` | the write fence against erasures |
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from dss.config import Quotas
from dss.db.connect import transaction
from dss.dialogue.versions.branches import Branches
from dss.dialogue.versions.check import version_store_problems
from dss.dialogue.versions.commits import Commits
from dss.dialogue.versions.deletion import Deletions
from dss.dialogue.versions.fence import UserFence, WriteFence
from dss.dialogue.versions.reads import VersionReads
from dss.dialogue.versions.sessions import SessionCatalog
from dss.dialogue.versions.tokens import TokenReads
from dss.dialogue.versions.tree import VersionTree
from dss.jsonlimits import JsonLimits


class VersionStore:
    """Sessions, branches and versions of every user, over a SQLAlchemy session factory.

    Every row is keyed by its owner first: `(user_id, session_id, ...)`. A query never names a
    session without its user, so one user's ids say nothing about another's.
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        quotas: Quotas | None = None,
        json_limits: JsonLimits | None = None,
        fence: WriteFence | None = None,
    ) -> None:
        self._factory = session_factory
        quotas = quotas if quotas is not None else Quotas()
        json_limits = json_limits if json_limits is not None else JsonLimits()
        user_fence = UserFence(fence)
        self.hold_user = user_fence.hold_user
        self.subject_of = user_fence.subject_of

        sessions = SessionCatalog(session_factory, quotas, json_limits, user_fence)
        self.create_session = sessions.create_session
        self.get_session = sessions.get_session
        self.ensure_session = sessions.ensure_session
        self.list_sessions = sessions.list_sessions
        self.set_retention = sessions.set_retention
        self.set_metadata = sessions.set_metadata
        self.retention_hints = sessions.retention_hints

        self.commit = Commits(session_factory, quotas, json_limits, user_fence).commit

        branches = Branches(session_factory, user_fence)
        self.branch = branches.branch
        self.rollback = branches.rollback
        self.list_branches = branches.list_branches
        self.get_branch = branches.get_branch

        reads = VersionReads(session_factory)
        self.get_version = reads.get_version
        self.list_versions = reads.list_versions
        self.version_page = reads.version_page
        self.find_deepest_prefix_version = reads.find_deepest_prefix_version

        tokens = TokenReads(session_factory)
        self.version_tokens = tokens.version_tokens
        self.iter_tokens = tokens.iter_tokens

        tree = VersionTree(session_factory)
        self.ancestors = tree.ancestors
        self.lineage = tree.lineage
        self.subtree = tree.subtree

        deletions = Deletions(session_factory, user_fence)
        self.delete_session = deletions.delete_session
        self.hold_session = deletions.hold_session
        self.delete_subtree = deletions.delete_subtree
        self.holds_user = deletions.holds_user
        self.delete_user_sessions = deletions.delete_user_sessions

    def check(self) -> list[str]:
        """Every broken invariant of the version store, as readable lines (empty = healthy)."""
        with transaction(self._factory) as db:
            return version_store_problems(db)
