"""The write fence that orders a user's writes against erasures of that user.

Every transaction of the version store that writes or deletes rows of a user calls `hold_user`
before its first write (or row lock): an erasure of the user then runs entirely before or
entirely after those writes, never between them.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy.orm import Session

from dss.types import UserId


class WriteFence(Protocol):
    """Orders the writes of a user's rows against erasures of that user (`Identity.fence_in`):
    called before the first write of every transaction that writes or deletes rows of `user`;
    raises `UserErased` when `admitted` (the erasure epoch the request was admitted under; None:
    any) is no longer the user's. Returns the user's epoch."""

    def fence_in(self, session: Session, user: UserId, admitted: int | None) -> int: ...

    def subject_hash(self, user: UserId) -> str:
        """The user's keyed subject hash, written on the user's sessions and stored responses
        (their `subject`), by which an erasure's verification finds them."""
        ...


class UserFence:
    """The store's `WriteFence`, or none (a bare `VersionStore`: then holding does nothing)."""

    def __init__(self, fence: WriteFence | None) -> None:
        self._fence = fence

    def hold_user(self, db: Session, user: UserId, epoch: int | None = None) -> None:
        """The write fence (`WriteFence`), before the first write (or row lock) of a transaction
        that writes rows of `user`: an erasure of the user then runs entirely before or entirely
        after the writes, and `UserErased` when `epoch` (the one the request was admitted under;
        None: any) is not the user's any more. Without a fence (a bare `VersionStore`), nothing."""
        if self._fence is not None:
            self._fence.fence_in(db, user, epoch)

    def subject_of(self, user: UserId) -> str | None:
        """What the `subject` column of a new row of `user` holds (`WriteFence.subject_hash`);
        None without a fence (a bare `VersionStore`: no identity to derive it)."""
        return self._fence.subject_hash(user) if self._fence is not None else None
