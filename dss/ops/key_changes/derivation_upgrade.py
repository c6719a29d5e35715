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

An operation over the parts (in `ops`): each table is changed by its owner, in this one
transaction: the epochs by `Identity`, the data keys by `dss.keys.keyring`, the page rows by
`dss.pages.rows`, the users named by `dss.dialogue.users` and, for API keys, by what the API
passes in (`users_elsewhere_in`; its tables are its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.db import receipt_rows
from dss.db.connect import transaction
from dss.db.store_meta import meta_get, meta_insert_in, meta_value_in
from dss.dialogue.users import every_stored_user_in
from dss.keys.identity import DERIVATION, DERIVATION_LEGACY_META, DERIVATION_META, Identity
from dss.keys.keyring import delete_all_but_in
from dss.pages.rows import delete_all_in
from dss.types import PUBLIC_TENANT, UserId

log = logging.getLogger("dss.keys")  # the logger operators know the upgrade's warning by

UsersIn = Callable[[Session], set[UserId]]
"""Users a table outside `dss` names (the API's keys), read in the upgrade's transaction."""


@dataclass(frozen=True, slots=True)
class DerivationUpgrade:
    epochs_rekeyed: int
    epochs_unknown: int  # epoch rows of users the store does not know: left under the old hash
    page_rows_deleted: int
    data_keys_deleted: int


def upgrade_derivation(
    sf: sessionmaker[Session], identity: Identity, users_elsewhere_in: UsersIn | None = None
) -> DerivationUpgrade | None:
    """Upgrade once; None when the store is already on the current derivation.
    `users_elsewhere_in`: the users of the API's keys, whose epochs move too."""
    if meta_get(sf, DERIVATION_META) == DERIVATION:
        return None
    try:
        with transaction(sf) as s:
            if meta_value_in(s, DERIVATION_META) is not None:
                return None
            # A second upgrader blocks here until we commit, then fails on the key.
            meta_insert_in(s, DERIVATION_META, DERIVATION)
            if receipt_rows.any_in(s):
                meta_insert_in(s, DERIVATION_LEGACY_META, "1")
            users = every_stored_user_in(s)
            if users_elsewhere_in is not None:
                users |= users_elsewhere_in(s)
            rekeyed, unknown = identity.rekey_legacy_epochs_in(s, users)
            pages = delete_all_in(s)
            keys = delete_all_but_in(s, PUBLIC_TENANT)
    except IntegrityError:
        if meta_get(sf, DERIVATION_META) == DERIVATION:
            return None  # another server upgraded meanwhile
        raise
    identity.forget_all()
    report = DerivationUpgrade(rekeyed, unknown, pages, keys)
    log.warning(
        "upgraded this store to length-prefixed tenant derivation: %s; the KV cache starts cold", report
    )
    return report
