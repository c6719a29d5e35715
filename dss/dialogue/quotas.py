"""Per-user quotas on the dialogue state: sessions, versions and stored bytes.

Checked inside the transaction that would exceed them (a session create, a commit), so a user
over quota gets `QuotaExceeded` (HTTP 429 with Retry-After) and nothing is written. Two commits
racing at the limit may both land: a quota bounds growth, it is not an exact counter. Quotas
bound the durable dialogue rows; cached KV pages are bounded by the tiers' capacities.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from dss.config import Quotas
from dss.db.models import SessionRow, VersionRow
from dss.errors import QuotaExceeded
from dss.types import UserId


def check_session_quota(db: Session, user: UserId, quotas: Quotas) -> None:
    if not quotas.max_sessions:
        return
    n = db.scalar(select(func.count()).select_from(SessionRow).where(SessionRow.user_id == user)) or 0
    if n >= quotas.max_sessions:
        raise QuotaExceeded(
            f"user has {n} sessions, the quota is {quotas.max_sessions}: delete some first",
            quotas.retry_after_s,
        )


def check_commit_quota(db: Session, user: UserId, quotas: Quotas, adding_bytes: int) -> None:
    if not (quotas.max_versions or quotas.max_stored_bytes):
        return
    n, stored = db.execute(
        select(func.count(), func.coalesce(func.sum(VersionRow.body_bytes), 0)).where(
            VersionRow.user_id == user
        )
    ).one()
    if quotas.max_versions and n >= quotas.max_versions:
        raise QuotaExceeded(
            f"user has {n} versions, the quota is {quotas.max_versions}: delete sessions first",
            quotas.retry_after_s,
        )
    if quotas.max_stored_bytes and stored + adding_bytes > quotas.max_stored_bytes:
        raise QuotaExceeded(
            f"user stores {stored} bytes of dialogue, this turn would pass the quota of "
            f"{quotas.max_stored_bytes}: delete sessions first",
            quotas.retry_after_s,
        )
