"""Branches: naming a version, moving a head back, reading heads (`Branches`).

A branch is a name whose `head_version` points into its session's version tree (`EMPTY_HEAD`, 0:
no versions yet). A rollback moves a head back to an ancestor-or-self of where it is, with a
compare-and-set (`move_head`): versions after it stay stored and listed, since another branch may
still point at them. No branch is ever deleted here; a session's `main` always exists.
"""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy.exc import IntegrityError

from dss.db.connect import transaction
from dss.db.models import BranchRow, utcnow
from dss.db.write_gate import first_in_line
from dss.dialogue.versions.records import BranchInfo, branch_info
from dss.dialogue.versions.rules import EMPTY_HEAD, check_name, check_number
from dss.dialogue.versions.shared import (
    MAX_COMMIT_ATTEMPTS,
    LostRace,
    VersionTables,
    branch_row,
    branch_rows,
    move_head,
    on_history_of,
    owned_session,
    touch,
    version_exists,
)
from dss.errors import BranchExists, DSSError, NotAnAncestor, StaleHead
from dss.types import SessionId, UserId


class Branches(VersionTables):
    """A session's branches: create one at a version, roll one back, read them."""

    def rollback(
        self,
        user: UserId,
        sid: SessionId,
        branch: str,
        to_version: int,
        expected_head: int | None = None,
        *,
        epoch: int | None = None,
    ) -> BranchInfo:
        """Move `branch`'s head back to `to_version`, an ancestor-or-self of the current head.

        Versions after it stay stored and listed (another branch may still point at them).
        A short write a client waits for: its transaction goes first among this process's waiting
        SQLite writers (`first_in_line`). `epoch`: as for `VersionWrites.commit`.
        """
        for _ in range(MAX_COMMIT_ATTEMPTS):
            try:
                with first_in_line(), transaction(self._factory) as db:
                    # Read first: on SQLite no lock is held yet (the write lock comes with the
                    # fence, the first write), so other writers are not kept waiting behind these
                    # reads; the compare-and-set on the head checks that what was read still holds
                    # (versions never change parents, and a deleted one moves the heads above it).
                    try:
                        brow = branch_row(db, user, sid, branch, missing_ok=False)
                        head = brow.head_version
                        if expected_head is not None and head != expected_head:
                            raise StaleHead(f"branch {branch!r} head is {head}, expected {expected_head}")
                        version_exists(db, user, sid, to_version)
                        if not on_history_of(db, user, sid, head, to_version):
                            raise NotAnAncestor(
                                f"version {to_version} is not on the history of branch {branch!r}"
                            )
                    except DSSError:
                        self.hold_user(db, user, epoch)  # `UserErased` first when the user was erased
                        owned_session(db, user, sid)  # `SessionNotFound` before a branch's absence
                        raise
                    self.hold_user(db, user, epoch)
                    move_head(db, user, sid, branch, head, to_version)
                    touch(db, user, sid)
                    return replace(branch_info(brow), head_version=to_version)
            except LostRace:
                if expected_head is not None:
                    raise StaleHead(f"branch {branch!r} head moved during the rollback") from None
        raise StaleHead(f"rollback of {sid!r}/{branch!r} lost {MAX_COMMIT_ATTEMPTS} races in a row")

    def branch(
        self, user: UserId, sid: SessionId, from_version: int, name: str, *, epoch: int | None = None
    ) -> BranchInfo:
        """A new branch `name` whose head is the existing version `from_version`
        (`EMPTY_HEAD`, 0: a branch with no versions yet, for a fork of a session's first turn).
        `epoch`: as for `VersionWrites.commit`."""
        check_name("branch name", name)
        check_number(from_version, sid)
        try:
            with first_in_line(), transaction(self._factory) as db:
                self.hold_user(db, user, epoch)
                owned_session(db, user, sid)
                if from_version != EMPTY_HEAD:
                    version_exists(db, user, sid, from_version)
                if branch_row(db, user, sid, name, missing_ok=True) is not None:
                    raise BranchExists(f"branch {name!r} already exists")
                row = BranchRow(
                    user_id=user, session_id=sid, name=name, head_version=from_version, created_at=utcnow()
                )
                db.add(row)
                db.flush()
                touch(db, user, sid)
                return branch_info(row)
        except IntegrityError as exc:
            # A concurrent writer created the same name (or deleted the session) in between:
            # `SessionNotFound` for the latter.
            with transaction(self._factory) as db:
                owned_session(db, user, sid)
            raise BranchExists(f"branch {name!r} already exists") from exc

    def list_branches(self, user: UserId, sid: SessionId) -> list[BranchInfo]:
        with transaction(self._factory) as db:
            owned_session(db, user, sid)
            return [branch_info(b) for b in branch_rows(db, user, sid)]

    def get_branch(self, user: UserId, sid: SessionId, name: str) -> BranchInfo:
        with transaction(self._factory) as db:
            owned_session(db, user, sid)
            return branch_info(branch_row(db, user, sid, name))
