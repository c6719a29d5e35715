"""Who a user is to the store: the master key check, the server secret, and the tenant salt.

The master key comes from `DSS_MASTER_KEY` or the key file; a store that already holds data never
silently gets a fresh one (a verifier in `store_meta` is checked). The server secret is random,
stored wrapped by the master key, and keys the HMACs that turn a user id into a tenant (the cache
namespace) and into the subject hash written in erasure receipts.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from dss.db.meta import meta_get, meta_set
from dss.db.models import ErasureEpoch
from dss.errors import UserErased, WrongMasterKey
from dss.keys.crypto import KeyManager
from dss.namespace import tenant_for_user
from dss.rpc import rpc_authkey
from dss.types import TenantId

log = logging.getLogger("dss.keys")

_VERIFIER_KEY = "master_key_verifier"
_SECRET_KEY = "server_secret_wrapped"


def load_master_key(sf: sessionmaker[Session], key_file: Path, create_if_missing: bool) -> KeyManager:
    verifier = meta_get(sf, _VERIFIER_KEY)
    keys = KeyManager.load(key_file, create_if_missing=create_if_missing and verifier is None)
    if keys.generated:
        log.warning(
            "generated a new master key at %s: back it up; without it the disk tier is unreadable", key_file
        )
    if verifier is None:
        meta_set(sf, _VERIFIER_KEY, keys.make_verifier().hex())
        return keys
    try:
        keys.check_verifier(bytes.fromhex(verifier))
    except WrongMasterKey:
        raise
    except Exception as exc:
        raise WrongMasterKey(f"master key from {keys.source} does not open this store") from exc
    return keys


class Identity:
    """Derives tenants and receipt subjects from user ids under the server secret.

    A user's tenant includes the user's erasure epoch (table `erasure_epochs`, keyed by the subject
    hash): each erasure moves the user to a tenant nothing was stored under, so a re-created user
    starts cold in every tier and in the engine's own prefix cache (its salt is the tenant), and
    the old tenant can be refused for good (`Keyring.retire`).

    Lock: `_lock` is a leaf around the epoch cache; the database is read outside it. An erasure
    bumps the epoch in its own transaction and then `forget`s the cached one; a generation number
    keeps a read that raced the erasure from caching the old epoch.

    The write fence: the user's `erasure_epochs` row is the lock that orders an erasure against
    every write of the user's rows. A write takes it shared before the first write of its
    transaction (`fence_in`; its reads before lock nothing), an erasure takes it exclusive
    before anything else of its own (`next_epoch_in`), then deletes. So a racing write either
    commits first (and the erasure, which reads after its lock, deletes what it wrote) or runs
    after the erasure, sees the new epoch, and is refused when it was admitted under the old one
    (`UserErased`). PostgreSQL: the row is locked `FOR SHARE` / `FOR UPDATE` (created first if
    missing, so there is always a row to lock); SQLite: the upsert that makes sure the row exists
    takes the database's one write lock, so the epoch read after it is the latest and nothing
    commits in between. Always the epoch row first, then the user's rows: one lock order, no
    deadlock between the two.
    """

    def __init__(self, server_secret: bytes, session_factory: sessionmaker[Session]) -> None:
        self._secret = server_secret
        self._sf = session_factory
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}  # by subject hash
        self._generation = 0

    @classmethod
    def load(cls, sf: sessionmaker[Session], keys: KeyManager) -> Identity:
        wrapped = meta_get(sf, _SECRET_KEY)
        if wrapped is None:
            secret = secrets.token_bytes(32)
            meta_set(sf, _SECRET_KEY, keys.wrap(secret, "server-secret").hex())
            return cls(secret, sf)
        return cls(keys.unwrap(bytes.fromhex(wrapped), "server-secret"), sf)

    def tenant_for(self, user: str) -> TenantId:
        return tenant_for_user(self._secret, user, self.epoch_of(user))

    def tenant_at(self, user: str, epoch: int) -> TenantId:
        """The user's tenant in erasure epoch `epoch` (a request's, fixed when it was admitted)."""
        return tenant_for_user(self._secret, user, epoch)

    def tenants_of(self, user: str, through: int | None = None) -> list[TenantId]:
        """Every tenant the user had (up to epoch `through`; default: the current one), the
        current one last (receipts name the erased ones)."""
        last = self.epoch_of(user) if through is None else through
        return [tenant_for_user(self._secret, user, e) for e in range(last + 1)]

    def epoch_of(self, user: str) -> int:
        subject = self.subject_hash(user)
        with self._lock:
            epoch = self._epochs.get(subject)
            generation = self._generation
        if epoch is not None:
            return epoch
        with self._sf() as s:
            row = s.get(ErasureEpoch, subject)
            epoch = row.epoch if row is not None else 0
        with self._lock:
            if self._generation == generation:
                self._epochs[subject] = epoch
        return epoch

    def stored_epoch_in(self, session: Session, user: str) -> int:
        """The user's epoch as the database has it now (not the cache), without a row lock."""
        stored = session.scalar(
            select(ErasureEpoch.epoch).where(ErasureEpoch.subject == self.subject_hash(user))
        )
        return int(stored) if stored is not None else 0

    def fence_in(self, session: Session, user: str, admitted: int | None) -> int:
        """The write fence (see the class docstring), before the first write of a transaction that
        writes rows of `user`: holds the user's epoch row shared until the transaction ends and
        returns the epoch. `UserErased` when `admitted` (the epoch the request was admitted
        under; None: any) is not the current one: the user was erased since."""
        epoch = self._lock_epoch_row(session, user, exclusive=False)
        if admitted is not None and epoch != admitted:
            self.forget(user)  # the cache may hold the old epoch (another server's erasure)
            raise UserErased("the user was erased while this request was in flight; nothing of it was kept")
        return epoch

    def next_epoch_in(self, session: Session, user: str, expected: int | None = None) -> int:
        """Before any other write or row lock of an erasure's transaction: lock the user's epoch
        row (racing writes of the user commit before, or wait and are refused after) and move the
        user to the next epoch (returned); the user has the new tenant once it commits.
        `expected`: the epoch the erasure read before it erased that epoch's tenant (erasures of
        one user are serialised, so it has not moved; if it did, `UserErased` and nothing is
        done). Call `forget` after the commit."""
        epoch = self._lock_epoch_row(session, user, exclusive=True)
        if expected is not None and epoch != expected:
            raise UserErased(f"the user was erased by another erasure meanwhile (epoch {epoch}); erase again")
        session.execute(
            update(ErasureEpoch)
            .where(ErasureEpoch.subject == self.subject_hash(user))
            .values(epoch=epoch + 1)
            .execution_options(synchronize_session=False)
        )
        return epoch + 1

    def _lock_epoch_row(self, session: Session, user: str, exclusive: bool) -> int:
        """Create the user's epoch row if missing, then read it under a row lock (shared or
        exclusive; on SQLite the upsert has taken the database write lock already)."""
        subject = self.subject_hash(user)
        dialect = session.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        session.execute(
            insert(ErasureEpoch)
            .values(subject=subject, epoch=0)
            .on_conflict_do_nothing(index_elements=["subject"])
        )
        q = select(ErasureEpoch.epoch).where(ErasureEpoch.subject == subject)
        return int(session.scalar(q.with_for_update(read=not exclusive)) or 0)

    def forget(self, user: str) -> None:
        with self._lock:
            self._epochs.pop(self.subject_hash(user), None)
            self._generation += 1

    def forget_all(self) -> None:
        """Forget every cached epoch. Another server of the fleet erased a user (it bumped that
        user's epoch in the shared database): this server does not know which user id is behind
        the erased tenant, so every user's next `tenant_for` reads its epoch again."""
        with self._lock:
            self._epochs.clear()
            self._generation += 1

    def subject_hash(self, user: str) -> str:
        """The salted hash of a user id written into erasure receipts (never the id itself)."""
        return hashlib.blake2b(
            b"dss-subject\x00" + user.encode(), key=self._secret[:32], digest_size=20
        ).hexdigest()

    def rpc_authkey(self) -> bytes:
        """The engines' RPC authkey: the same for every owner of this store, so an engine
        configured with it reaches a restarted owner."""
        return rpc_authkey(self._secret)
