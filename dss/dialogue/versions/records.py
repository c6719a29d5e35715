"""The version store's records (what its reads return) and the one builder of each from its rows."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from dss.db.models import BranchRow, SessionRow, VersionRow, aware
from dss.dialogue.versions.rules import EMPTY_HEAD, EMPTY_TOKENS
from dss.errors import (
    BranchNotFound,
)
from dss.jsonlimits import JsonLimits, servable
from dss.tokens import TOKEN_DTYPE
from dss.types import FingerprintId, SessionId, UserId

log = logging.getLogger("dss.versions")


@dataclass(frozen=True, slots=True)
class BranchInfo:
    name: str
    head_version: int  # EMPTY_HEAD (0) when the branch has no versions yet
    created_at: datetime

    @property
    def is_empty(self) -> bool:
        return self.head_version == EMPTY_HEAD


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: SessionId
    user_id: UserId
    created_at: datetime
    updated_at: datetime
    system_prompt: str | None
    metadata: dict[str, Any]
    version_count: int
    branches: tuple[BranchInfo, ...]
    kv_retention: str = "normal"  # one of KV_RETENTIONS (see `dss.ops.retention`)
    kv_idle_ttl_s: int | None = None  # idle seconds before its host pages move to disk; None: never

    def branch(self, name: str) -> BranchInfo:
        for b in self.branches:
            if b.name == name:
                return b
        raise BranchNotFound(f"branch {name!r} not found")


@dataclass(frozen=True, slots=True)
class VersionSummary:
    """A version without its token and message bodies (what listings return)."""

    session_id: SessionId
    number: int
    parent: int | None
    branch: str  # the branch it was committed on
    created_at: datetime
    n_tokens: int
    fingerprint: str | None


@dataclass(frozen=True, slots=True)
class VersionInfo(VersionSummary):
    tokens: np.ndarray  # int32, read-only
    messages: list[dict[str, Any]]
    # What the model saw where it differs from `messages` (`dss.dialogue.lead.view`); None: the same.
    seen: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class VersionTokens:
    """A version's token ids without its messages (what `iter_tokens` yields)."""

    session_id: SessionId
    number: int
    fingerprint: FingerprintId | None
    tokens: np.ndarray  # int32, read-only


@dataclass(frozen=True, slots=True)
class RetentionHint:
    """A session's KV retention hint, without its branches (what the retention sweeper reads)."""

    user_id: UserId
    session_id: SessionId
    kv_retention: str
    kv_idle_ttl_s: int | None
    updated_at: datetime


def branch_info(row: BranchRow) -> BranchInfo:
    return BranchInfo(name=row.name, head_version=row.head_version, created_at=aware(row.created_at))


def session_info(row: SessionRow, branches: Iterable[BranchRow], limits: JsonLimits) -> SessionInfo:
    meta = dict(row.meta or {})
    if not servable(meta, limits):
        # Stored before the depth limit existed: serving it would fail the user's whole listing.
        log.warning("stored session metadata nested over %d levels deep: served empty", limits.max_depth)
        meta = {}
    return SessionInfo(
        id=SessionId(row.id),
        user_id=UserId(row.user_id),
        created_at=aware(row.created_at),
        updated_at=aware(row.updated_at),
        system_prompt=row.system_prompt,
        metadata=meta,
        version_count=row.version_count,
        branches=tuple(branch_info(b) for b in branches),
        kv_retention=row.kv_retention,
        kv_idle_ttl_s=row.kv_idle_ttl_s,
    )


SUMMARY_COLS = (
    VersionRow.session_id,
    VersionRow.number,
    VersionRow.parent,
    VersionRow.branch,
    VersionRow.created_at,
    VersionRow.n_tokens,
    VersionRow.fingerprint,
)


def summary_fields(r: Any) -> dict[str, Any]:
    """The `VersionSummary` fields of a version row (or of a row of `SUMMARY_COLS`)."""
    return {
        "session_id": SessionId(r.session_id),
        "number": r.number,
        "parent": r.parent,
        "branch": r.branch,
        "created_at": aware(r.created_at),
        "n_tokens": r.n_tokens,
        "fingerprint": r.fingerprint,
    }


def version_summary(r: Any) -> VersionSummary:
    return VersionSummary(**summary_fields(r))


def full_version(r: VersionRow, messages: list[dict[str, Any]]) -> VersionInfo:
    tokens = np.frombuffer(r.tokens, dtype=TOKEN_DTYPE) if r.tokens else EMPTY_TOKENS
    return VersionInfo(**summary_fields(r), tokens=tokens, messages=messages, seen=r.seen)
