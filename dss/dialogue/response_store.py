"""Stored responses of the OpenAI Responses API, each one a version of a session.

A response record holds what `GET /v1/responses/{id}` returns (model, status, instructions, the
input items as given, the output items, usage, sampling parameters) and names the version it
committed: the conversation up to and including its output, tokens and messages. A chain of
responses (`previous_response_id`) lives in one session, one session per chain root; continuing
an older response than the newest forks, and the version tree of the session is the response
tree. So the versions give the responses what they have everywhere else: durable across restarts,
branchable, erased with their user.

Invariants (`ResponseStore.check`):
- every record's version exists, in the record's session of the record's user;
- a `previous_response_id` names a record of the same user in the same session, and that
  record's version is a strict ancestor of this one's (so chains end, and every response that
  continues another lies in the version subtree of the one it continues);
- ids are `resp_` followed by 48 hex digits (`new_response_id`): the chain's route key (16 digits,
  `dss.dialogue.route_keys`: what a router hashes on) then 128 random bits, unguessable; another
  user's id reads as missing, exactly like an unknown one.

DELETE (`ResponseStore.delete`) never breaks a descendant silently. A response's descendants are
every other version of its version's subtree (the versions below it) and every other response
holding one of those versions (or its own version):
- a leaf (no descendants): its record and its version are deleted;
- with descendants and without `cascade`: nothing is deleted; `ResponseHasDescendants` (a
  ConflictError, HTTP 409) names the descendant responses and counts the other versions (ones
  committed through the session API on top of it), and carries both as attributes;
- with `cascade=True`: the response, every descendant response record and the whole version
  subtree (its version and all versions below it) are deleted in one transaction.
Either way, branch heads that pointed into the deleted subtree move to the parent of the
response's version (0, an empty branch, when it had none); no branch is deleted, `main` never.
Version numbers are not reused. The KV pages of deleted versions are not deleted here: pages are
content-addressed and shared by every version of the user (in any session) that has the same
token prefix, so they leave with eviction or with the user's erasure. Deleting the session
(`VersionStore.delete_session`, `DELETE /v1/sessions/{id}`) or erasing the user deletes every
response record of it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

from dss.db.connect import transaction
from dss.db.models import ResponseRow, VersionRow
from dss.dialogue.route_keys import checked_route_key, new_route_key
from dss.dialogue.versions import VersionStore
from dss.errors import (
    InvalidInput,
    LimitExceeded,
    ResponseExists,
    ResponseHasDescendants,
    ResponseNotFound,
    VersionNotFound,
)
from dss.jsonlimits import JsonLimits, check_items, check_json
from dss.types import SessionId, UserId

RESPONSE_ID_PREFIX = "resp_"
_ID_RE = re.compile(r"resp_[0-9a-f]{48}")
# OpenAI's response statuses; a stored response is normally completed or incomplete.
STATUSES = ("completed", "incomplete", "failed", "cancelled", "in_progress", "queued")
MAX_MODEL_CHARS = 256
# Bytes of JSON of one record's items, usage and parameters together (the messages themselves
# are also in its version).
MAX_RECORD_BYTES = 16 << 20
# How many ids an error message lists (the exception carries them all).
_LISTED_IDS = 20
_IN_CHUNK = 500


def new_response_id(route_key: str | None = None) -> str:
    """A fresh response id: `resp_`, the route key (a random one when None), 32 random hex digits."""
    key = checked_route_key(route_key) or new_route_key()
    return RESPONSE_ID_PREFIX + key + secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    id: str  # "resp_" + 48 hex chars, made by new_response_id()
    user: UserId
    session_id: SessionId  # the session holding the chain (one session per chain root)
    version: int  # the version committed for this response (prompt + output tokens, messages)
    previous_response_id: str | None
    created_at: datetime  # timezone-aware UTC
    model: str
    status: str  # "completed" | "incomplete"
    instructions: str | None
    input_items: list[dict[str, Any]]  # the request's input items as given (normalised to item dicts)
    output: list[dict[str, Any]]  # the output items as returned
    usage: dict[str, Any]
    params: dict[str, Any]  # temperature, top_p, max_output_tokens, metadata, incomplete_details ...


@dataclass(frozen=True, slots=True)
class Descendants:
    """What continues from a response: the other responses in its version's subtree (by version,
    then creation) and every version below its own (`versions`, ascending)."""

    response_ids: list[str]
    versions: list[int]
    other_versions: list[int]  # of `versions`, those no descendant response holds

    @property
    def empty(self) -> bool:
        return not self.response_ids and not self.versions


@dataclass(frozen=True, slots=True)
class Deleted:
    """What a delete removed: response ids (the one asked for first) and version numbers (ascending)."""

    response_ids: list[str]
    versions: list[int]


def _aware(ts: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything is stored in UTC.
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def _record(row: ResponseRow) -> ResponseRecord:
    return ResponseRecord(
        id=row.id,
        user=UserId(row.user_id),
        session_id=SessionId(row.session_id),
        version=row.version,
        previous_response_id=row.previous_response_id,
        created_at=_aware(row.created_at),
        model=row.model,
        status=row.status,
        instructions=row.instructions,
        input_items=list(row.input_items),
        output=list(row.output),
        usage=dict(row.usage),
        params=dict(row.params),
    )


def _plain_json(
    record: ResponseRecord, limits: JsonLimits
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The record's JSON parts as they will come back from the database; `InvalidInput` for
    anything that is not JSON, `LimitExceeded` past MAX_RECORD_BYTES or past `limits` (each
    structured field of an item, each parameter: named as the request names it)."""
    named = (("input_items", "input", record.input_items), ("output", "output", record.output))
    for kind, name, items in named:
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise InvalidInput(f"{kind} must be a list of JSON objects")
        check_items(name, items, limits)
    for kind, obj in (("usage", record.usage), ("params", record.params)):
        if not isinstance(obj, dict):
            raise InvalidInput(f"{kind} must be a JSON object")
        for key, value in obj.items():
            check_json(key, value, limits)
    parts = [record.input_items, record.output, record.usage, record.params]
    try:
        text = json.dumps(parts, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"a response record is not JSON-serialisable: {exc}") from exc
    if len(text.encode()) > MAX_RECORD_BYTES:
        raise LimitExceeded(f"a response record over {MAX_RECORD_BYTES} bytes of JSON")
    inputs, output, usage, params = json.loads(text)
    return inputs, output, usage, params


def _check_record(record: ResponseRecord) -> None:
    if not isinstance(record.id, str) or _ID_RE.fullmatch(record.id) is None:
        raise InvalidInput(f"response id must be {RESPONSE_ID_PREFIX!r} and 48 hex digits, got {record.id!r}")
    prev = record.previous_response_id
    if prev is not None and (not isinstance(prev, str) or _ID_RE.fullmatch(prev) is None):
        raise ResponseNotFound(f"response {prev!r} not found")
    if prev == record.id:
        raise InvalidInput("a response cannot continue itself")
    if record.status not in STATUSES:
        raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {record.status!r}")
    if not isinstance(record.model, str) or not 0 < len(record.model) <= MAX_MODEL_CHARS:
        raise InvalidInput(f"model must be 1-{MAX_MODEL_CHARS} characters")
    if not isinstance(record.created_at, datetime) or record.created_at.tzinfo is None:
        raise InvalidInput("created_at must be a timezone-aware datetime")


def _not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"response {response_id!r} not found")


class ResponseStore:
    """Stored responses of every user, over the metadata database and the version store.

    Every query names the owner: another user's response raises `ResponseNotFound`, exactly like
    an unknown id. Version rows are read and deleted only through `VersionStore`.
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        versions: VersionStore,
        json_limits: JsonLimits | None = None,
    ) -> None:
        self._factory = session_factory
        self._versions = versions
        self._json_limits = json_limits if json_limits is not None else JsonLimits()

    # --- writes --------------------------------------------------------------------------------
    def add(self, record: ResponseRecord, *, epoch: int | None = None) -> None:
        """Store `record`. Its version must exist in its session of its user (`VersionNotFound`,
        also for a session that is missing or another user's); a `previous_response_id` must be a
        response of the same user (`ResponseNotFound`) in the same session whose version is an
        ancestor of this one's (`InvalidInput`); an id already used raises `ResponseExists`.
        `epoch`: the erasure epoch the request was admitted under (`UserErased` when the user was
        erased since; `VersionStore.hold_user`)."""
        _check_record(record)
        inputs, output, usage, params = _plain_json(record, self._json_limits)
        user, sid = record.user, record.session_id
        try:
            with transaction(self._factory) as db:
                self._versions.hold_user(db, user, epoch)
                lineage = self._versions.lineage(user, sid, record.version, db)
                if record.previous_response_id is not None:
                    prev = self._row(db, user, record.previous_response_id)
                    if prev.session_id != sid:
                        raise InvalidInput(
                            f"response {prev.id!r} is in another session than version {record.version}"
                        )
                    if prev.version not in lineage[1:]:
                        raise InvalidInput(
                            f"version {record.version} does not continue the version {prev.version} "
                            f"of response {prev.id!r}"
                        )
                if db.get(ResponseRow, record.id) is not None:
                    raise ResponseExists(f"response id {record.id!r} is already in use")
                db.add(
                    ResponseRow(
                        id=record.id,
                        user_id=user,
                        subject=self._versions.subject_of(user),
                        session_id=sid,
                        version=record.version,
                        previous_response_id=record.previous_response_id,
                        created_at=record.created_at.astimezone(UTC),
                        model=record.model,
                        status=record.status,
                        instructions=record.instructions,
                        input_items=inputs,
                        output=output,
                        usage=usage,
                        params=params,
                    )
                )
                db.flush()
        except IntegrityError as exc:
            # A writer got in between: the same id stored, or the version deleted (foreign key).
            with transaction(self._factory) as db:
                if db.get(ResponseRow, record.id) is not None:
                    raise ResponseExists(f"response id {record.id!r} is already in use") from exc
            raise VersionNotFound(f"version {record.version} not found in session {sid!r}") from exc

    def delete(self, user: UserId, response_id: str, cascade: bool = False) -> Deleted:
        """Delete a response as the module docstring says: a leaf with its version; one with
        descendants only with `cascade` (then with all of them and its version subtree, in one
        transaction), else `ResponseHasDescendants` and nothing deleted."""
        with transaction(self._factory) as db:
            self._versions.hold_user(db, user)  # erasures of the user first or after, never between
            row = self._row(db, user, response_id)
            sid = SessionId(row.session_id)
            # Held before the subtree is read: no commit or delete of the session gets in between.
            self._versions.hold_session(user, sid, db)
            row = self._row(db, user, response_id)  # still there now that nobody else can write
            found = self._descendants(db, row)
            if not found.empty and not cascade:
                raise ResponseHasDescendants(
                    _descendants_message(response_id, found), list(found.response_ids), list(found.versions)
                )
            versions = self._versions.delete_subtree(user, sid, row.version, db)
            return Deleted(response_ids=[response_id, *found.response_ids], versions=versions)

    # --- reads ---------------------------------------------------------------------------------
    def get(self, user: UserId, response_id: str) -> ResponseRecord:
        with transaction(self._factory) as db:
            return _record(self._row(db, user, response_id))

    def chain(self, user: UserId, response_id: str) -> list[ResponseRecord]:
        """The response and those it continues, root first and this one last, in one recursive
        query along `previous_response_id`."""
        with transaction(self._factory) as db:
            self._row(db, user, response_id)
            r = aliased(ResponseRow)
            walk = (
                select(ResponseRow.id, ResponseRow.previous_response_id, ResponseRow.version)
                .where(ResponseRow.user_id == user, ResponseRow.id == response_id)
                .cte("walk", recursive=True)
            )
            walk = walk.union_all(
                select(r.id, r.previous_response_id, r.version)
                .join(walk, r.id == walk.c.previous_response_id)
                .where(r.user_id == user)
            )
            ids = list(db.scalars(select(walk.c.id)))
            rows: dict[str, ResponseRow] = {}
            for i in range(0, len(ids), _IN_CHUNK):
                chunk = select(ResponseRow).where(ResponseRow.id.in_(ids[i : i + _IN_CHUNK]))
                rows.update((row.id, row) for row in db.scalars(chunk))
            # Versions grow along a chain (each one's ancestor is the previous), so by version is root first.
            return sorted((_record(rows[i]) for i in ids), key=lambda rec: rec.version)

    def descendants(self, user: UserId, response_id: str) -> Descendants:
        """The responses and versions that continue from this response (see the module docstring)."""
        with transaction(self._factory) as db:
            return self._descendants(db, self._row(db, user, response_id))

    # --- invariants ----------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Every broken invariant of the stored responses, as readable lines (empty = healthy)."""
        problems: list[str] = []
        with transaction(self._factory) as db:
            parents: dict[tuple[str, str], dict[int, int | None]] = {}
            for u, sid, number, parent in db.execute(
                select(VersionRow.user_id, VersionRow.session_id, VersionRow.number, VersionRow.parent)
            ).tuples():
                parents.setdefault((u, sid), {})[number] = parent
            rows: dict[str, tuple[str, str, int, str | None]] = {}
            for rid, u, sid, version, prev, status in db.execute(
                select(
                    ResponseRow.id,
                    ResponseRow.user_id,
                    ResponseRow.session_id,
                    ResponseRow.version,
                    ResponseRow.previous_response_id,
                    ResponseRow.status,
                )
            ).tuples():
                rows[rid] = (u, sid, version, prev)
                if _ID_RE.fullmatch(rid) is None:
                    problems.append(f"response {rid!r}: malformed id")
                if status not in STATUSES:
                    problems.append(f"response {rid}: unknown status {status!r}")
            for rid, (u, sid, version, prev) in rows.items():
                tree = parents.get((u, sid), {})
                if version not in tree:
                    problems.append(f"response {rid}: version {sid}/{version} does not exist")
                    continue
                if prev is None:
                    continue
                if prev not in rows:
                    problems.append(f"response {rid}: previous response {prev} does not exist")
                    continue
                pu, psid, pversion, _ = rows[prev]
                if (pu, psid) != (u, sid):
                    problems.append(f"response {rid}: previous response {prev} is in another session")
                    continue
                ancestors: set[int] = set()
                cur = tree.get(version)
                while cur is not None and cur not in ancestors:
                    ancestors.add(cur)
                    cur = tree.get(cur)
                if pversion not in ancestors:
                    problems.append(
                        f"response {rid}: version {version} does not descend from {pversion} of {prev}"
                    )
        return problems

    # --- internals -----------------------------------------------------------------------------
    @staticmethod
    def _row(db: Session, user: UserId, response_id: str) -> ResponseRow:
        if not isinstance(response_id, str) or _ID_RE.fullmatch(response_id) is None:
            raise _not_found(response_id)
        row = db.scalar(select(ResponseRow).where(ResponseRow.user_id == user, ResponseRow.id == response_id))
        if row is None:
            raise _not_found(response_id)
        return row

    def _descendants(self, db: Session, row: ResponseRow) -> Descendants:
        subtree = self._versions.subtree(UserId(row.user_id), SessionId(row.session_id), row.version, db)
        held: list[tuple[int, Any, str]] = []
        for i in range(0, len(subtree), _IN_CHUNK):
            held.extend(
                db.execute(
                    select(ResponseRow.version, ResponseRow.created_at, ResponseRow.id).where(
                        ResponseRow.user_id == row.user_id,
                        ResponseRow.session_id == row.session_id,
                        ResponseRow.version.in_(subtree[i : i + _IN_CHUNK]),
                        ResponseRow.id != row.id,
                    )
                ).tuples()
            )
        held.sort()
        below = subtree[1:]
        theirs = {version for version, _, _ in held}
        return Descendants(
            response_ids=[rid for _, _, rid in held],
            versions=below,
            other_versions=[v for v in below if v not in theirs],
        )


def _descendants_message(response_id: str, found: Descendants) -> str:
    parts = []
    if found.response_ids:
        listed = ", ".join(found.response_ids[:_LISTED_IDS])
        more = len(found.response_ids) - _LISTED_IDS
        parts.append(
            f"{len(found.response_ids)} response(s) continue from it ({listed}"
            + (f", and {more} more)" if more > 0 else ")")
        )
    if found.other_versions:
        parts.append(f"{len(found.other_versions)} other version(s) of its session descend from it")
    return (
        f"response {response_id!r} is not deleted: " + "; ".join(parts) + ". Delete with cascade to delete "
        "them too (the response, its descendants and their versions)."
    )
