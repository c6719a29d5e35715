"""API keys: the `api_keys` table (`ApiKeys`).

A key is shown once when it is created; the database keeps only its SHA-256 (the keys are 256
random bits, so a fast hash is enough: nothing can be brute-forced from it). A user key acts as
its user; an admin key (acting as `api.auth.ADMIN_USER`) may also erase users, manage public
prefixes and read metrics; a frontend key acts for the end users of a registered frontend
(`api.keys.frontends`). Authenticating a key gives an `api.auth.Caller`. Every creation and
revocation is written to the audit trail (`api.keys.audit`) in the same transaction.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.auth import ADMIN_USER, Caller, FrontendAccess, check_user_name
from api.keys.audit import ACTOR_CLI, AuditAction, record
from dss.db.connect import transaction
from dss.db.models import ApiKeyRow, FrontendRow, aware
from dss.errors import ApiKeyNotFound, FrontendNotFound, InvalidInput
from dss.types import UserId

log = logging.getLogger("dss.api.keys")

KEY_PREFIX = "dss-"
KeyKind = Literal["user", "admin", "frontend"]
_ANY_KEY_TTL_S = 2.0
# How a key look-up that reached `ApiKeys.authenticate` ended (the `dss_api_key_lookups_total`
# outcomes): found in the database, unknown there, answered from the memory of unknown tokens
# (no query), or not a DSS key at all (no query).
LookupOutcome = Literal["found", "unknown", "remembered_unknown", "not_a_key"]
LOOKUP_OUTCOMES: tuple[LookupOutcome, ...] = ("found", "unknown", "remembered_unknown", "not_a_key")


@dataclass(frozen=True, slots=True)
class CreatedKey:
    id: str
    key: str  # the secret; shown once, never stored
    user: UserId | None  # None for a frontend key
    is_admin: bool
    frontend: str | None = None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    user: UserId | None  # None for a frontend key
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None
    frontend: str | None = None

    @property
    def kind(self) -> KeyKind:
        return "admin" if self.is_admin else "frontend" if self.frontend is not None else "user"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The `api_keys` table, with a short-lived cache of validated keys and a short-lived memory
    of unknown tokens (a client repeating a wrong or revoked key costs one query per
    `unknown_ttl_s`, not one per request). Lock: `_lock` is a leaf around both; no I/O under it."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        cache_ttl_s: float = 10.0,
        unknown_ttl_s: float = 5.0,
        unknown_max: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        on_lookup: Callable[[LookupOutcome], object] | None = None,
    ) -> None:
        self._sf = session_factory
        self._ttl = cache_ttl_s
        self._unknown_ttl = unknown_ttl_s
        self._unknown_max = unknown_max
        self._clock = clock
        self._on_lookup = on_lookup
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Caller]] = {}
        # Digests of tokens the database did not know -> when that answer expires; oldest first.
        self._unknown: OrderedDict[str, float] = OrderedDict()
        # Bumped by every `forget_cached`: a caller read from the database before it is not
        # cached, so a revocation or a frontend's new headers cannot be undone by a look-up
        # that was in flight while they were committed.
        self._generation = 0
        # Bumped by every `create`: an "unknown" read before a key was made is not remembered.
        self._creations = 0
        self._any: tuple[float, bool] | None = None

    def create(
        self,
        user: str | None = None,
        admin: bool = False,
        frontend: str | None = None,
        actor: str = ACTOR_CLI,
    ) -> CreatedKey:
        """A new key for `user`, an admin key, or a key of the registered `frontend`
        (`FrontendNotFound` if it is not); audited as done by `actor`."""
        owner: UserId | None
        if admin:
            # One admin identity: an admin key "for bob" would share bob's sessions with his keys.
            if (user is not None and user != ADMIN_USER) or frontend is not None:
                raise InvalidInput(f"an admin key acts as the user {ADMIN_USER!r}; give no user nor frontend")
            owner = ADMIN_USER
        elif frontend is not None:
            if user is not None:
                raise InvalidInput("a frontend key acts for the end users its requests name; give no user")
            owner = None
        elif user is None:
            raise InvalidInput("a user key needs a user id")
        else:
            owner = check_user_name(user)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        kid = "key_" + uuid.uuid4().hex[:16]
        with transaction(self._sf) as db:
            if frontend is not None and db.get(FrontendRow, frontend) is None:
                raise FrontendNotFound(f"no frontend {frontend!r}")
            db.add(
                ApiKeyRow(id=kid, key_hash=hash_key(key), user_id=owner, is_admin=admin, frontend=frontend)
            )
            kind = "admin" if admin else "frontend" if frontend is not None else "user"
            record(
                db, actor, AuditAction.KEY_CREATED, kid, {"kind": kind, "user": owner, "frontend": frontend}
            )
        with self._lock:
            self._any = None
            self._creations += 1
            self._unknown.pop(hash_key(key), None)
        return CreatedKey(kid, key, owner, admin, frontend)

    def cached(self, key: str) -> Caller | None:
        """The caller of a key validated within the cache's lifetime, else None (then ask
        `authenticate`). No I/O: the event loop may call it."""
        digest = hash_key(key)
        now = self._clock()
        with self._lock:
            hit = self._cache.get(digest)
        return hit[1] if hit is not None and hit[0] > now else None

    def authenticate(self, key: str) -> Caller | None:
        """The caller of an active key, or None for an unknown or revoked one (or a frontend
        key whose frontend is gone). A token the database did not know a moment ago is answered
        None without asking it again, and one that is not a DSS key at all is never looked up."""
        hit = self.cached(key)
        if hit is not None:
            return hit
        if not key.startswith(KEY_PREFIX):  # every key is made with the prefix
            self._report("not_a_key")
            return None
        digest = hash_key(key)
        now = self._clock()
        with self._lock:
            generation, creations = self._generation, self._creations
            remembered = self._unknown_until(digest, now)
        if remembered:
            self._report("remembered_unknown")
            return None
        with transaction(self._sf) as db:
            row = db.scalar(
                select(ApiKeyRow).where(ApiKeyRow.key_hash == digest, ApiKeyRow.revoked_at.is_(None))
            )
            if row is None:
                self._remember_unknown(digest, now, creations)
                self._report("unknown")
                return None
            if row.frontend is not None and not row.is_admin:
                fe = db.get(FrontendRow, row.frontend)
                if fe is None:
                    log.warning("refusing frontend key %s: its frontend is not registered", row.id)
                    return None
                access = FrontendAccess(
                    fe.name,
                    tuple(fe.user_headers),
                    fe.session_header,
                    fe.lead_updates,
                    tuple(fe.volatile_patterns or ()),
                    bool(fe.trust_dss_user_header),
                    bool(fe.trust_body_user),
                )
                caller = Caller(None, False, row.id, frontend=access)
            else:
                caller = Caller(UserId(row.user_id or ADMIN_USER), bool(row.is_admin), row.id)
        if caller.user == ADMIN_USER and not caller.is_admin:
            # Made before the name was reserved: it would act on the admin's sessions.
            log.warning("refusing user key %s: it names the reserved user %r", caller.key_id, ADMIN_USER)
            return None
        with self._lock:
            if self._generation == generation:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[digest] = (now + self._ttl, caller)
        self._report("found")
        return caller

    def _unknown_until(self, digest: str, now: float) -> bool:
        """Under `_lock`: whether `digest` is remembered unknown at `now` (an expired entry goes)."""
        until = self._unknown.get(digest)
        if until is None:
            return False
        if until > now:
            return True
        del self._unknown[digest]
        return False

    def _remember_unknown(self, digest: str, now: float, creations: int) -> None:
        if self._unknown_ttl <= 0:
            return
        with self._lock:
            if self._creations != creations:
                return  # a key was made meanwhile: it may be this one
            self._unknown[digest] = now + self._unknown_ttl
            self._unknown.move_to_end(digest)
            while len(self._unknown) > self._unknown_max:
                self._unknown.popitem(last=False)

    def _report(self, outcome: LookupOutcome) -> None:
        if self._on_lookup is not None:
            self._on_lookup(outcome)

    def forget_cached(self) -> None:
        """Drop the validated keys: a frontend's headers changed (or a key was revoked)."""
        with self._lock:
            self._cache.clear()
            self._generation += 1

    def any_active(self) -> bool:
        now = self._clock()
        with self._lock:
            if self._any is not None and self._any[0] > now:
                return self._any[1]
        with transaction(self._sf) as db:
            n = (
                db.scalar(select(func.count()).select_from(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None)))
                or 0
            )
        with self._lock:
            self._any = (now + _ANY_KEY_TTL_S, n > 0)
        return n > 0

    def revoke(self, key_id: str, actor: str = ACTOR_CLI) -> bool:
        """Revoke an active key (audited); False when there is no active key `key_id`."""
        with transaction(self._sf) as db:
            result = db.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=datetime.now(UTC))
            )
            n = cast(CursorResult[Any], result).rowcount
            if n:
                record(db, actor, AuditAction.KEY_REVOKED, key_id, {})
        self.forget_cached()
        with self._lock:
            self._any = None
        return bool(n)

    def holds_user(self, user: UserId) -> bool:
        """Whether any key, active or revoked, was made for `user`."""
        with transaction(self._sf) as db:
            return db.scalar(select(ApiKeyRow.id).where(ApiKeyRow.user_id == user).limit(1)) is not None

    def list(self) -> list[KeyInfo]:
        with transaction(self._sf) as db:
            rows = db.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id))
            return [_key_info(r) for r in rows]

    def get(self, key_id: str) -> KeyInfo:
        with transaction(self._sf) as db:
            row = db.get(ApiKeyRow, key_id)
            if row is None:
                raise ApiKeyNotFound(f"no API key {key_id!r}")
            return _key_info(row)


def _key_info(r: ApiKeyRow) -> KeyInfo:
    user = None if r.frontend is not None and not r.is_admin else UserId(r.user_id or ADMIN_USER)
    revoked = aware(r.revoked_at) if r.revoked_at is not None else None
    return KeyInfo(r.id, user, bool(r.is_admin), aware(r.created_at), revoked, r.frontend)
