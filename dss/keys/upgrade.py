"""The one-time upgrade of a store made under the first (ambiguous) derivation of tenants,
subject hashes and namespace ids to the length-prefixed one (`dss.derive`).

What was derived before cannot be mapped to the new derivation without the user ids, and a page
cannot be moved to another tenant at all (its hash chain starts from the namespace, its file's
header and associated data name the tenant). So, in one transaction at open:

- erasure epochs move to the new subject hash of every user the store knows (sessions, stored
  responses, API keys): a user erased before the upgrade keeps their epoch. An epoch row of a
  user the store does not know (erased, no key left) stays under its old hash, unused: that user
  starts again at epoch 0, whose new tenant nothing was ever stored under either;
- every page row (of every server) and every data key except the public tenant's are deleted:
  the KV cache is recomputable, and deleting the keys shreds every copy of the old pages (files,
  Redis, backups of the files). Each server's recovery then removes its orphan files;
- the old tenants erasures retired stay retired (the keyring reads them from the receipts), and
  old receipts keep their subjects: `Identity.legacy` keeps a user's old tenants and subject hash
  theirs, so the receipts still verify (the chain is unchanged) and are listed for their user.

Every server of a fleet must run the new code: stop them all, start one, then the others (an old
server would go on deriving the old tenants). Two servers upgrading at once: one inserts the
version row first, the other's transaction fails on it and finds the upgrade done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.meta import meta_get
from dss.db.models import (
    ApiKeyRow,
    DataKey,
    ErasureEpoch,
    ErasureReceiptRow,
    PageRow,
    ResponseRow,
    SessionRow,
    StoreMeta,
)
from dss.keys.identity import DERIVATION, DERIVATION_LEGACY_META, DERIVATION_META, Identity
from dss.types import PUBLIC_TENANT, UserId

log = logging.getLogger("dss.keys")


@dataclass(frozen=True, slots=True)
class DerivationUpgrade:
    epochs_rekeyed: int
    epochs_unknown: int  # epoch rows of users the store does not know: left under the old hash
    page_rows_deleted: int
    data_keys_deleted: int


def upgrade_derivation(sf: sessionmaker[Session], identity: Identity) -> DerivationUpgrade | None:
    """Upgrade once; None when the store is already on the current derivation."""
    if meta_get(sf, DERIVATION_META) == DERIVATION:
        return None
    try:
        with transaction(sf) as s:
            if s.get(StoreMeta, DERIVATION_META) is not None:
                return None
            s.add(StoreMeta(key=DERIVATION_META, value=DERIVATION))
            s.flush()  # a second upgrader blocks here until we commit, then fails on the key
            if s.scalar(select(func.count()).select_from(ErasureReceiptRow)):
                s.add(StoreMeta(key=DERIVATION_LEGACY_META, value="1"))
            rekeyed = _rekey_epochs(s, identity)
            unknown = int(s.scalar(select(func.count()).select_from(ErasureEpoch)) or 0) - rekeyed
            pages = cast(CursorResult[Any], s.execute(delete(PageRow))).rowcount
            keys = cast(
                CursorResult[Any], s.execute(delete(DataKey).where(DataKey.tenant != PUBLIC_TENANT))
            ).rowcount
    except IntegrityError:
        if meta_get(sf, DERIVATION_META) == DERIVATION:
            return None  # another server upgraded meanwhile
        raise
    identity.forget_all()
    report = DerivationUpgrade(rekeyed, unknown, int(pages), int(keys))
    log.warning(
        "upgraded this store to length-prefixed tenant derivation: %s; the KV cache starts cold", report
    )
    return report


def _rekey_epochs(s: Session, identity: Identity) -> int:
    users: set[UserId] = {UserId(u) for u in s.execute(select(SessionRow.user_id).distinct()).scalars()}
    users |= {UserId(u) for u in s.execute(select(ResponseRow.user_id).distinct()).scalars()}
    users |= {UserId(u) for u in s.execute(select(ApiKeyRow.user_id).distinct()).scalars() if u}
    n = 0
    for user in sorted(users):
        old = s.get(ErasureEpoch, identity.legacy_subject_hash(user))
        if old is None:
            continue
        epoch = old.epoch
        s.delete(old)
        s.flush()
        s.add(ErasureEpoch(subject=identity.subject_hash(user), epoch=epoch))
        n += 1
    return n
