"""Who a user is to the store: the master key check, the server secret, and the tenant salt.

The master key comes from `DSS_MASTER_KEY` or the key file; a store that already holds data never
silently gets a fresh one (a verifier in `store_meta` is checked). The server secret is random,
stored wrapped by the master key, and keys the HMACs that turn a user id into a tenant (the cache
namespace) and into the subject hash written in erasure receipts.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from dss.config import DEFAULT_CACHE_ENTRIES
from dss.db.models import ErasureEpoch
from dss.db.store_meta import meta_get, meta_set_default, meta_value_in
from dss.derive import keyed_blake2b, rpc_authkey
from dss.errors import MasterKeyRotated, UserErased, WrongMasterKey
from dss.keys.bounded import BoundedLru
from dss.keys.crypto import KeyManager, env_master_key_set, finish_rotation
from dss.namespace import legacy_tenant_for_user, tenant_for_user
from dss.types import TenantId, UserId

log = logging.getLogger("dss.keys")

MASTER_VERIFIER_META = "master_key_verifier"
SERVER_SECRET_META = "server_secret_wrapped"
SERVER_SECRET_AAD = "server-secret"  # the "tenant" the server secret is wrapped as
# The derivation of tenants and subjects this store's data was made under (`dss.derive`): absent
# in a store made before fields were length-prefixed, which
# `dss.ops.key_changes.derivation_upgrade` upgrades at open; DERIVATION_LEGACY_META says the store
# was upgraded and holds receipts of the first derivation.
DERIVATION_META = "derivation"
DERIVATION = "2"
DERIVATION_LEGACY_META = "derivation_upgraded_from"


def load_master_key(sf: sessionmaker[Session], key_file: Path, create_if_missing: bool) -> KeyManager:
    """The master key, checked against the store's verifier. On PostgreSQL the verifier is read
    under a shared lock of its row, which a rotation holds exclusively for its whole transaction
    (`dss.ops.key_changes.master_rotation.rewrap_all`): a server starting during a rotation waits
    for it and then reads the new verifier. Its registration in `servers` (`Membership.register`)
    came first, so a rotation that takes the row after this read sees the server alive and
    refuses."""
    verifier = _read_verifier(sf)
    try:
        keys = KeyManager.load(key_file, create_if_missing=create_if_missing and verifier is None)
        if verifier is not None:
            _check(keys, verifier)
    except WrongMasterKey:
        # A rotation killed between its commit and replacing the key file: finish it.
        finished = (
            None
            if verifier is None or env_master_key_set()
            else finish_rotation(key_file, bytes.fromhex(verifier))
        )
        if finished is None:
            raise
        log.warning("finished an interrupted master-key rotation: %s now holds the new key", key_file)
        return finished
    if keys.generated:
        log.warning(
            "generated a new master key at %s: back it up; without it the disk tier is unreadable", key_file
        )
    if verifier is None:
        stored = meta_set_default(sf, MASTER_VERIFIER_META, keys.make_verifier().hex())
        _check(keys, stored)  # another server opening the new store first: its key must be ours
    return keys


def _read_verifier(sf: sessionmaker[Session]) -> str | None:
    with sf() as s, s.begin():
        return verifier_in(s)


def verifier_in(db: Session) -> str | None:
    """The master-key verifier, read in the caller's transaction; on PostgreSQL under a shared
    lock of its row (`FOR SHARE`) held until that transaction ends, so that no rotation commits
    in between (a rotation locks the row `FOR UPDATE` first)."""
    return meta_value_in(db, MASTER_VERIFIER_META, lock="share")


def check_master_in(db: Session, keys: KeyManager) -> None:
    """In a transaction about to store something wrapped under `keys` (a new data key): the
    store's verifier still opens with `keys`, and stays so until the transaction ends (PostgreSQL:
    its row is held `FOR SHARE`). `MasterKeyRotated` when a rotation changed it since this server
    read the key: what it would wrap no restart could unwrap. SQLite: nothing to do, a rotation
    takes the data directory's owner lock, so no server runs beside it."""
    if db.get_bind().dialect.name != "postgresql":
        return
    verifier = verifier_in(db)
    if verifier is None:
        return  # a store being created: `load_master_key` writes the verifier
    try:
        keys.check_verifier(bytes.fromhex(verifier))
    except WrongMasterKey as exc:
        raise MasterKeyRotated(
            "the master key was rotated since this server started; restart it with the new key "
            "(no data key is wrapped under the old one)"
        ) from exc


def _check(keys: KeyManager, verifier: str) -> None:
    try:
        keys.check_verifier(bytes.fromhex(verifier))
    except WrongMasterKey:
        raise
    except Exception as exc:
        raise WrongMasterKey(f"master key from {keys.source} does not open this store") from exc


class Identity:
    """Derives tenants and receipt subjects from user ids under the server secret.

    A user's tenant includes the user's erasure epoch (table `erasure_epochs`, keyed by the subject
    hash): each erasure moves the user to a tenant nothing was stored under, so a re-created user
    starts cold in every tier and in the engine's own prefix cache (its salt is the tenant), and
    the old tenant can be refused for good (`Keyring.retire`).

    Lock: `_lock` is a leaf around the epoch cache; the database is read outside it. An erasure
    bumps the epoch in its own transaction and then `forget`s the cached one; a generation number
    keeps a read that raced the erasure from caching the old epoch. The cache holds at most
    `epoch_cache_entries` users (`StoreConfig.identity_cache_entries`; user ids are chosen by
    frontends, so it must not grow with them): the least recently used is dropped, in memory
    only, and read again from the database when it is next needed, so an evicted epoch is never
    a stale one. (The write fence does not rely on the cache either: `fence_in` reads the row.)

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

    def __init__(
        self,
        server_secret: bytes,
        session_factory: sessionmaker[Session],
        legacy: bool = False,
        epoch_cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self._secret = server_secret
        # Whether the store holds receipts of the first (ambiguous) derivation: then a user's old
        # tenants and subject hash of that form are still theirs (`tenants_of`, `legacy_subject_hash`).
        self.legacy = legacy
        self._sf = session_factory
        self._lock = threading.Lock()
        self._epochs: BoundedLru[str, int] = BoundedLru(epoch_cache_entries)  # by subject hash
        self._generation = 0

    @classmethod
    def load(
        cls, sf: sessionmaker[Session], keys: KeyManager, epoch_cache_entries: int = DEFAULT_CACHE_ENTRIES
    ) -> Identity:
        wrapped = meta_get(sf, SERVER_SECRET_META)
        if wrapped is None:
            secret = secrets.token_bytes(32)
            mine = keys.wrap(secret, SERVER_SECRET_AAD).hex()
            meta_set_default(sf, DERIVATION_META, DERIVATION)  # first: a new store never needs the upgrade
            # Every server of a store must derive tenants from one secret: when another server
            # opening the same new store stored its secret first, that one is the store's.
            wrapped = meta_set_default(sf, SERVER_SECRET_META, mine)
            if wrapped == mine:
                return cls(secret, sf, epoch_cache_entries=epoch_cache_entries)
        # Not upgraded yet (`dss.ops.key_changes.derivation_upgrade` runs next), or upgraded with
        # old receipts to honour.
        legacy = (
            meta_get(sf, DERIVATION_META) != DERIVATION or meta_get(sf, DERIVATION_LEGACY_META) is not None
        )
        secret = keys.unwrap(bytes.fromhex(wrapped), SERVER_SECRET_AAD)
        return cls(secret, sf, legacy=legacy, epoch_cache_entries=epoch_cache_entries)

    def tenant_for(self, user: UserId) -> TenantId:
        return tenant_for_user(self._secret, user, self.epoch_of(user))

    def tenant_at(self, user: UserId, epoch: int) -> TenantId:
        """The user's tenant in erasure epoch `epoch` (a request's, fixed when it was admitted)."""
        return tenant_for_user(self._secret, user, epoch)

    def tenants_of(self, user: UserId, through: int | None = None) -> list[TenantId]:
        """Every tenant the user had (up to epoch `through`; default: the current one), the current
        one last (receipts name the erased ones); in a store upgraded from the first derivation,
        also the tenants of that form (first)."""
        epochs = range((self.epoch_of(user) if through is None else through) + 1)
        legacy = [legacy_tenant_for_user(self._secret, user, e) for e in epochs] if self.legacy else []
        return [*legacy, *(tenant_for_user(self._secret, user, e) for e in epochs)]

    def users_having(self, tenant: TenantId, users: Iterable[UserId]) -> list[UserId]:
        """Which of `users` ever had `tenant` (one tenant per erasure epoch, as `tenants_of`). The
        epochs come from one query, not one per user: a verification over 20,000 users spent 13 s
        reading them one by one. A verification needs it only for rows without a `subject`
        (written before migration 0013); the others are found by the receipt's `user_subject`."""
        by_subject = {self.subject_hash(u): u for u in users}
        with self._sf() as s:
            epochs = dict(s.execute(select(ErasureEpoch.subject, ErasureEpoch.epoch)).tuples().all())
        found = []
        for subject, user in by_subject.items():
            last = epochs.get(subject, 0)
            if any(tenant_for_user(self._secret, user, e) == tenant for e in range(last + 1)):
                found.append(user)
        return sorted(found)

    def epoch_of(self, user: UserId) -> int:
        """The user's erasure epoch now: what a request is admitted under. Its writes pass it on
        (`epoch=`) and are refused with `UserErased` once the user was erased since."""
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
                self._epochs.put(subject, epoch)
        return epoch

    def stored_epoch_in(self, db: Session, user: UserId) -> int:
        """The user's epoch as the database has it now (not the cache), without a row lock."""
        stored = db.scalar(select(ErasureEpoch.epoch).where(ErasureEpoch.subject == self.subject_hash(user)))
        return int(stored) if stored is not None else 0

    def fence_in(self, db: Session, user: UserId, admitted: int | None) -> int:
        """The write fence (see the class docstring), before the first write of a transaction that
        writes rows of `user`: holds the user's epoch row shared until the transaction ends and
        returns the epoch. `UserErased` when `admitted` (the epoch the request was admitted
        under; None: any) is not the current one: the user was erased since."""
        epoch = self._lock_epoch_row(db, user, exclusive=False)
        if admitted is not None and epoch != admitted:
            self.forget(user)  # the cache may hold the old epoch (another server's erasure)
            raise UserErased("the user was erased while this request was in flight; nothing of it was kept")
        return epoch

    def next_epoch_in(self, db: Session, user: UserId, expected: int | None = None) -> int:
        """Before any other write or row lock of an erasure's transaction: lock the user's epoch
        row (racing writes of the user commit before, or wait and are refused after) and move the
        user to the next epoch (returned); the user has the new tenant once it commits.
        `expected`: the epoch the erasure read before it erased that epoch's tenant (erasures of
        one user are serialised, so it has not moved; if it did, `UserErased` and nothing is
        done). Call `forget` after the commit."""
        epoch = self._lock_epoch_row(db, user, exclusive=True)
        if expected is not None and epoch != expected:
            raise UserErased(f"the user was erased by another erasure meanwhile (epoch {epoch}); erase again")
        db.execute(
            update(ErasureEpoch)
            .where(ErasureEpoch.subject == self.subject_hash(user))
            .values(epoch=epoch + 1)
            .execution_options(synchronize_session=False)
        )
        return epoch + 1

    def _lock_epoch_row(self, db: Session, user: UserId, exclusive: bool) -> int:
        """Create the user's epoch row if missing, then read it under a row lock (shared or
        exclusive; on SQLite the upsert has taken the database write lock already)."""
        subject = self.subject_hash(user)
        dialect = db.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        db.execute(
            insert(ErasureEpoch)
            .values(subject=subject, epoch=0)
            .on_conflict_do_nothing(index_elements=["subject"])
        )
        q = select(ErasureEpoch.epoch).where(ErasureEpoch.subject == subject)
        return int(db.scalar(q.with_for_update(read=not exclusive)) or 0)

    def forget(self, user: UserId) -> None:
        with self._lock:
            self._epochs.pop(self.subject_hash(user))
            self._generation += 1

    def cached_epochs(self) -> int:
        """How many users' epochs are cached now (at most `epoch_cache_entries`)."""
        with self._lock:
            return len(self._epochs)

    def forget_all(self) -> None:
        """Forget every cached epoch. Another server of the fleet erased a user (it bumped that
        user's epoch in the shared database): this server does not know which user id is behind
        the erased tenant, so every user's next `tenant_for` reads its epoch again."""
        with self._lock:
            self._epochs.clear()
            self._generation += 1

    def subject_hash(self, user: UserId) -> str:
        """The salted hash of a user id (keys `erasure_epochs`; named receipts before epochs)."""
        return keyed_blake2b(self._secret[:32], "dss/subject/v2", user, digest_size=20).hex()

    def legacy_subject_hash(self, user: UserId) -> str:
        """The first derivation's subject hash: what `erasure_epochs` and the oldest receipts
        were keyed by before the upgrade (`dss.ops.key_changes.derivation_upgrade`)."""
        return hashlib.blake2b(
            b"dss-subject\x00" + user.encode(), key=self._secret[:32], digest_size=20
        ).hexdigest()

    def rekey_legacy_epochs_in(self, s: Session, users: Iterable[UserId]) -> tuple[int, int]:
        """The tenant-derivation upgrade, in its transaction: the erasure epoch of each of `users`
        moves from the first derivation's subject hash to the current one. Returns how many
        moved, and how many epoch rows stay under an old hash (users no table names)."""
        n = 0
        for user in sorted(set(users)):
            old = s.get(ErasureEpoch, self.legacy_subject_hash(user))
            if old is None:
                continue
            epoch = old.epoch
            s.delete(old)
            s.flush()
            s.add(ErasureEpoch(subject=self.subject_hash(user), epoch=epoch))
            n += 1
        total = int(s.scalar(select(func.count()).select_from(ErasureEpoch)) or 0)
        return n, total - n

    def receipt_subjects(self, user: UserId) -> set[str]:
        """What the user's erasure receipts may name: every tenant the user had (and, for receipts
        written before tenants had epochs, the subject hash)."""
        subjects = {*self.tenants_of(user), self.subject_hash(user)}
        if self.legacy:
            subjects.add(self.legacy_subject_hash(user))
        return subjects

    def cache_salt(self, user: UserId, epoch: int | None = None) -> str:
        """The engine prefix-cache salt of `user` (in `epoch`; default: the current one): the
        tenant, which moves with each erasure of the user (vLLM's own cache keeps an erased
        user's blocks until they age out; a re-created user must not hit them)."""
        return str(self.tenant_for(user) if epoch is None else self.tenant_at(user, epoch))

    def seal(self, label: str, *fields: str) -> str:
        """An HMAC-SHA256 (hex) of `fields` under the server secret, for records the database
        holds but must not be able to forge (the receipt chain's checkpoints). Every part is
        length-prefixed, so no two different (label, fields) give the same input."""
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (label, *fields):
            data = part.encode()
            mac.update(len(data).to_bytes(8, "big") + data)
        return mac.hexdigest()

    def rpc_authkey(self) -> bytes:
        """The engines' RPC authkey: the same for every owner of this store, so an engine
        configured with it reaches a restarted owner."""
        return rpc_authkey(self._secret)
