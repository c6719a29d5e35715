"""Writing versions: appending one as the child of a branch head, deleting a subtree (`VersionWrites`).

Concurrency is optimistic and works the same on SQLite and PostgreSQL: a commit allocates its
number with a compare-and-set on `sessions.version_count` and moves the head with a
compare-and-set on `branches.head_version`; both must hold or the transaction rolls back and is
retried on what it reads again (`LostRace`, at most `MAX_COMMIT_ATTEMPTS` times). A caller that
pins the head (`parent` / `expected_head`) gets `StaleHead` instead of a retry on another head.

Numbers are never reused: a commit takes `version_count + 1` even where deleted subtrees left
gaps below it (`delete_subtree`, the Responses API's cascading DELETE, leaves them; branch heads
that pointed into a deleted subtree move to its parent). The user's quotas (versions, stored
bytes) are checked inside the transaction that would exceed them, and the write fence is held
before the first write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from dss.db.connect import transaction
from dss.db.models import BranchRow, ResponseRow, SessionRow, VersionRow, utcnow
from dss.dialogue.history import stored_form
from dss.dialogue.quotas import check_commit_quota
from dss.dialogue.versions.records import VersionInfo, full_version
from dss.dialogue.versions.rules import (
    EMPTY_HEAD,
    MAIN_BRANCH,
    check_number,
    coerce_tokens,
    json_size,
    normalised,
    normalised_record,
)
from dss.dialogue.versions.shared import (
    MAX_COMMIT_ATTEMPTS,
    LostRace,
    VersionTables,
    branch_row,
    descendants_of,
    in_chunks,
    move_head,
    owned_session,
    parents_having,
    rowcount,
    version_key,
)
from dss.errors import InvalidInput, SessionNotFound, StaleHead
from dss.jsonlimits import check_items
from dss.types import SessionId, UserId


class VersionWrites(VersionTables):
    """New versions on a branch head, under the user's quotas and write fence; deleting a version
    with its descendants."""

    def commit(
        self,
        user: UserId,
        sid: SessionId,
        *,
        tokens: Sequence[int] | np.ndarray,
        messages: Sequence[Mapping[str, Any]],
        branch: str = MAIN_BRANCH,
        parent: int | None = None,
        expected_head: int | None = None,
        fingerprint: str | None = None,
        epoch: int | None = None,
        seen: Mapping[str, Any] | None = None,
        parent_lead: Mapping[str, Any] | None = None,
    ) -> VersionInfo:
        """Append a version as the child of `branch`'s head and move the head to it.

        `parent` and `expected_head` both pin the head the caller built on (0 = empty branch):
        when the head is elsewhere, `StaleHead`. Without either, the commit goes on top of
        whatever the head is when it lands. `epoch`: the erasure epoch the turn was admitted
        under (`UserErased` when the user was erased since; see `VersionTables.hold_user`). `seen`:
        what the model saw where it differs from `messages` (`dss.dialogue.lead.view`).
        `parent_lead`: the parent's first message as the caller read it, so that a version whose
        first message alone differs is still stored as a delta (`dss.dialogue.history`).
        """
        arr = coerce_tokens(tokens)
        check_items("messages", messages, self._json_limits)  # before anything walks them recursively
        msgs = normalised(messages)
        seen_record = normalised_record(seen)
        if fingerprint is not None and len(fingerprint) > 64:
            raise InvalidInput("fingerprint longer than 64 characters")
        pinned = {h for h in (parent, expected_head) if h is not None}
        if len(pinned) > 1:
            raise InvalidInput(f"parent {parent} and expected_head {expected_head} disagree")
        want = pinned.pop() if pinned else None
        body = arr.tobytes()
        for _ in range(MAX_COMMIT_ATTEMPTS):
            try:
                return self._try_commit(
                    user,
                    sid,
                    branch,
                    want,
                    body,
                    int(arr.size),
                    msgs,
                    fingerprint,
                    epoch,
                    seen_record,
                    parent_lead,
                )
            except LostRace:
                continue
        raise StaleHead(f"commit on {sid!r}/{branch!r} lost {MAX_COMMIT_ATTEMPTS} races in a row")

    def _try_commit(
        self,
        user: UserId,
        sid: SessionId,
        branch: str,
        want: int | None,
        body: bytes,
        n_tokens: int,
        msgs: list[dict[str, Any]],
        fingerprint: str | None,
        epoch: int | None,
        seen: dict[str, Any] | None,
        parent_lead: Mapping[str, Any] | None,
    ) -> VersionInfo:
        with transaction(self._factory) as db:
            try:
                count = owned_session(db, user, sid).version_count
            except SessionNotFound:
                self.hold_user(db, user, epoch)  # `UserErased` when an erasure deleted it
                raise
            head = branch_row(db, user, sid, branch).head_version
            if want is not None and head != want:
                raise StaleHead(f"branch {branch!r} head is {head}, expected {want}")
            base = None
            if head != EMPTY_HEAD:
                row = db.execute(
                    select(VersionRow.n_messages, VersionRow.digest).where(
                        *version_key(user, sid), VersionRow.number == head
                    )
                ).one_or_none()
                if row is None:  # deleted (a cascade) after we read the head: re-read everything
                    raise LostRace
                base = (row[0], row[1])
            parent_n, parent_digest = base if base is not None else (None, None)
            stored = stored_form(msgs, parent_n, parent_digest, parent_lead)
            delta_bytes = json_size("messages", [*stored.delta, stored.lead or {}, seen or {}])
            check_commit_quota(db, user, self._quotas, len(body) + delta_bytes)
            # The fence before the first write (on SQLite it takes the write lock, so the quota's
            # sum above did not hold it); what was read before is checked by the compare-and-sets.
            self.hold_user(db, user, epoch)
            number = count + 1
            now = utcnow()
            # Both compare-and-sets must hold for the commit to stand; a miss means another writer
            # got in between, and the transaction is rolled back and everything re-read.
            took_number = rowcount(
                db,
                update(SessionRow)
                .where(SessionRow.user_id == user, SessionRow.id == sid, SessionRow.version_count == count)
                .values(version_count=number, updated_at=now),
            )
            if took_number != 1:
                raise LostRace
            move_head(db, user, sid, branch, head, number)
            parent = head if head != EMPTY_HEAD else None
            added = VersionRow(
                user_id=user,
                session_id=sid,
                number=number,
                parent=parent,
                branch=branch,
                created_at=now,
                n_tokens=n_tokens,
                tokens=body,
                messages=stored.delta,
                messages_base=stored.base,
                n_messages=stored.n_messages,
                digest=stored.digest,
                body_bytes=len(body) + delta_bytes,
                fingerprint=fingerprint,
                seen=seen,
                lead=stored.lead,
            )
            db.add(added)
            db.flush()
        return full_version(added, msgs)

    def delete_subtree(
        self, user: UserId, sid: SessionId, number: int, db: Session | None = None
    ) -> list[int]:
        """Delete version `number` and every version descending from it, with the stored responses
        that hold any of them; return the deleted numbers, ascending (`number` first).

        Branch heads that pointed into the subtree move to the parent of `number` (EMPTY_HEAD, 0,
        when it was a root); no branch is deleted, `main` included. Numbers are not reused. The
        session is held (`hold_session`) before anything is read, so a concurrent commit either
        lands first (and its version is in the subtree read here, deleted with it) or finds its
        head moved and retries on the new one. KV pages are not touched: they are content-addressed
        and shared in the user's trie. Pass `db` to run inside the caller's transaction.
        """
        if db is None:
            with transaction(self._factory) as own:
                return self.delete_subtree(user, sid, number, own)
        check_number(number, sid)  # before anything is locked or written
        self.hold_user(db, user)
        self.hold_session(user, sid, db)
        parents = parents_having(db, user, sid, number)
        doomed = descendants_of(parents, number)
        parent = parents[number]
        new_head = parent if parent is not None else EMPTY_HEAD
        for chunk in in_chunks(doomed):
            rowcount(
                db,
                update(BranchRow)
                .where(
                    BranchRow.user_id == user,
                    BranchRow.session_id == sid,
                    BranchRow.head_version.in_(chunk),
                )
                .values(head_version=new_head),
            )
            # Responses first: they reference their versions (where foreign-key actions are off too).
            rowcount(
                db,
                delete(ResponseRow).where(
                    ResponseRow.user_id == user,
                    ResponseRow.session_id == sid,
                    ResponseRow.version.in_(chunk),
                ),
            )
            rowcount(db, delete(VersionRow).where(*version_key(user, sid), VersionRow.number.in_(chunk)))
        return doomed
