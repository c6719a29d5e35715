"""Registered frontends: a chat frontend (Open WebUI, LibreChat, a company's own) whose keys act
for its end users.

A frontend has a name and the request headers its keys trust: `user_headers` name the end user,
`session_header` the session (besides `X-DSS-Session` and `X-Session-ID`). Whether its keys also
take the end user from the generic sources, `X-DSS-User` (`trust_dss_user_header`) and the body's
`user` and `safety_identifier` (`trust_body_user`), is its own choice: both on by default, off
for a frontend that forwards its end users' extra headers or body parameters (any end user could
name another otherwise). End user `alice` of frontend `webui` is the DSS user `webui/alice`
(`end_user_id`): an ordinary user of the store with its own sessions, tenant, cache salt,
quotas and receipts, unreachable from any other key: new plain user ids may not hold `/`
(`dss.inputs.check_user_id`), and a frontend is not registered under a name that stored data
already uses as `<name>/...` (ids of an older version, which allowed `/`).

Invariants: a name is one of the user-id alphabet (no `/`), at most `FRONTEND_NAME_MAX`
characters; header names are HTTP tokens, neither DSS's own (`api.headers`) nor reserved, and
no header is both a user and the session header; at least one source can name the end user.
Every change is audited in its transaction.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.headers import DSS_HEADERS, RESERVED_HEADERS
from api.keys.audit import AuditAction, record
from dss.db.connect import transaction
from dss.db.models import FRONTEND_NAME_LEN, HEADER_NAME_LEN, ApiKeyRow, FrontendRow, aware
from dss.dialogue.lead.policy import check_mode
from dss.dialogue.lead.volatile import check_patterns
from dss.dialogue.users import holds_users_under
from dss.errors import FrontendExists, FrontendNameTaken, FrontendNotFound, InvalidInput, InvalidUserId
from dss.inputs import MAX_USER_ID_CHARS, USER_ID_RULE, check_user_id
from dss.types import UserId

FRONTEND_NAME_MAX = FRONTEND_NAME_LEN  # the columns' widths
HEADER_NAME_MAX = HEADER_NAME_LEN
MAX_USER_HEADERS = 8
SEPARATOR = "/"
_TOKEN = re.compile(rf"[!#$%&'*+.^_`|~0-9A-Za-z-]{{1,{HEADER_NAME_MAX}}}")


class _Keep:
    """`update`'s marker for a field left as it is."""


KEEP: Final = _Keep()


@dataclass(frozen=True, slots=True)
class Frontend:
    name: str
    user_headers: tuple[str, ...]
    session_header: str | None
    created_at: datetime
    created_by: str
    # Lead updates for its keys' turns (`dss.dialogue.lead.policy`); None: the server's setting.
    lead_updates: str | None = None
    volatile_patterns: tuple[str, ...] = ()
    trust_dss_user_header: bool = True
    trust_body_user: bool = True


def check_frontend_name(name: str) -> str:
    """`name` if a frontend may take it: a user id (no `/`, no control character), not too long."""
    check_user_id(name)
    if len(name) > FRONTEND_NAME_MAX:
        raise InvalidInput(f"a frontend name is at most {FRONTEND_NAME_MAX} characters; got {len(name)}")
    return name


def check_header_name(name: str, field: str) -> str:
    if _TOKEN.fullmatch(name) is None:
        raise InvalidInput(
            f"{field}: {name[:200]!r} is not an HTTP header name (1-{HEADER_NAME_MAX} token characters)"
        )
    if name.lower() in DSS_HEADERS:
        raise InvalidInput(
            f"{field}: {name} is read by DSS itself on every frontend key; name another header"
        )
    if name.lower() in RESERVED_HEADERS:
        raise InvalidInput(f"{field}: {name} carries credentials or framing, never a user or a session")
    return name


def check_headers(
    user_headers: Sequence[str], session_header: str | None
) -> tuple[tuple[str, ...], str | None]:
    """The header settings of a frontend, checked (`InvalidInput` naming the field)."""
    if len(user_headers) > MAX_USER_HEADERS:
        raise InvalidInput(f"user_headers: at most {MAX_USER_HEADERS} headers")
    users = tuple(check_header_name(h, "user_headers") for h in user_headers)
    if len({h.lower() for h in users}) != len(users):
        raise InvalidInput("user_headers: a header is named twice")
    if session_header is not None:
        check_header_name(session_header, "session_header")
        if session_header.lower() in {h.lower() for h in users}:
            raise InvalidInput(f"session_header: {session_header} is one of the user_headers")
    return users, session_header


def check_sources(user_headers: Sequence[str], trust_dss_user_header: bool, trust_body_user: bool) -> None:
    """`InvalidInput` when a frontend's keys could name no end user: every request would be
    refused (`end_user_required`), which is a misconfiguration to report now, not per request."""
    if not (user_headers or trust_dss_user_header or trust_body_user):
        raise InvalidInput(
            "trust_dss_user_header: with no user_headers and trust_body_user off, the frontend's keys "
            "could name no end user; trust one source"
        )


def end_user_id(frontend: str, end_user: str, source: str) -> UserId:
    """The DSS user of `frontend`'s end user `end_user` (`<frontend>/<end user>`), or
    `InvalidUserId` naming `source` (the header or field it came from)."""
    try:
        check_user_id(end_user)
    except InvalidUserId as exc:
        raise InvalidUserId(f"{source}: {exc}") from None
    user = f"{frontend}{SEPARATOR}{end_user}"
    if len(user) > MAX_USER_ID_CHARS:
        room = MAX_USER_ID_CHARS - len(frontend) - 1
        raise InvalidUserId(f"{source}: {USER_ID_RULE}; an end user of {frontend!r} has at most {room}")
    return UserId(user)


def end_user_prefix(frontend: str) -> str:
    """What every DSS user id of `frontend`'s end users starts with."""
    return frontend + SEPARATOR


class Frontends:
    """The `frontends` table."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._sf = session_factory

    def find(self, name: str) -> Frontend | None:
        with transaction(self._sf) as db:
            row = db.get(FrontendRow, name)
            return _frontend(row) if row is not None else None

    def get(self, name: str) -> Frontend:
        found = self.find(name)
        if found is None:
            raise FrontendNotFound(f"no frontend {name!r}")
        return found

    def list(self) -> list[Frontend]:
        with transaction(self._sf) as db:
            return [_frontend(r) for r in db.scalars(select(FrontendRow).order_by(FrontendRow.name))]

    def create(
        self,
        name: str,
        user_headers: Sequence[str],
        session_header: str | None,
        actor: str,
        lead_updates: str | None = None,
        volatile_patterns: Sequence[str] = (),
        trust_dss_user_header: bool = True,
        trust_body_user: bool = True,
    ) -> Frontend:
        """Register a frontend; `FrontendExists` if the name is registered, `FrontendNameTaken`
        if stored data holds users named `<name>/...`."""
        check_frontend_name(name)
        users, session = check_headers(user_headers, session_header)
        check_sources(users, trust_dss_user_header, trust_body_user)
        lead, patterns = check_lead_settings(lead_updates, volatile_patterns)
        prefix = end_user_prefix(name)
        if holds_users_under(self._sf, prefix) or self._keys_under(prefix):
            raise FrontendNameTaken(
                f"stored data holds users named {prefix}... (made by an older version): a frontend "
                f"{name!r} would act as them; choose another name, or erase those users first"
            )
        try:
            with transaction(self._sf) as db:
                if db.get(FrontendRow, name) is not None:
                    raise FrontendExists(f"a frontend {name!r} is registered already")
                db.add(
                    FrontendRow(
                        name=name,
                        user_headers=list(users),
                        session_header=session,
                        created_by=actor,
                        lead_updates=lead,
                        volatile_patterns=patterns or None,
                        trust_dss_user_header=trust_dss_user_header,
                        trust_body_user=trust_body_user,
                    )
                )
                detail = {
                    "user_headers": list(users),
                    "session_header": session,
                    "lead_updates": lead,
                    "volatile_patterns": patterns,
                    "trust_dss_user_header": trust_dss_user_header,
                    "trust_body_user": trust_body_user,
                }
                record(db, actor, AuditAction.FRONTEND_CREATED, name, detail)
        except IntegrityError:  # created meanwhile by another caller
            raise FrontendExists(f"a frontend {name!r} is registered already") from None
        return self.get(name)

    def ensure(
        self,
        name: str,
        actor: str,
        user_headers: Sequence[str] = (),
        session_header: str | None = None,
        lead_updates: str | None = None,
        volatile_patterns: Sequence[str] = (),
        trust_dss_user_header: bool = True,
        trust_body_user: bool = True,
    ) -> bool:
        """Register `name` (as `create`) unless it is registered; whether this call registered
        it. A registration by another caller in between counts as registered, not as a conflict."""
        if self.find(name) is not None:
            return False
        try:
            self.create(
                name,
                user_headers,
                session_header,
                actor,
                lead_updates,
                volatile_patterns,
                trust_dss_user_header=trust_dss_user_header,
                trust_body_user=trust_body_user,
            )
        except FrontendExists:
            return False
        return True

    def update(
        self,
        name: str,
        actor: str,
        user_headers: Sequence[str] | _Keep = KEEP,
        session_header: str | _Keep | None = KEEP,
        lead_updates: str | _Keep | None = KEEP,
        volatile_patterns: Sequence[str] | _Keep = KEEP,
        trust_dss_user_header: bool | _Keep = KEEP,
        trust_body_user: bool | _Keep = KEEP,
    ) -> Frontend:
        """Change a frontend's trusted headers and sources, and its lead-update settings (fields
        left `KEEP` stay); audited when anything changes. Keys of the frontend see the change within their
        cache's lifetime."""
        with transaction(self._sf) as db:
            row = db.get(FrontendRow, name)
            if row is None:
                raise FrontendNotFound(f"no frontend {name!r}")
            was = _settings(row)
            users = tuple(row.user_headers) if isinstance(user_headers, _Keep) else tuple(user_headers)
            session = row.session_header if isinstance(session_header, _Keep) else session_header
            users, session = check_headers(users, session)
            dss_header = (
                row.trust_dss_user_header
                if isinstance(trust_dss_user_header, _Keep)
                else trust_dss_user_header
            )
            body_user = row.trust_body_user if isinstance(trust_body_user, _Keep) else trust_body_user
            check_sources(users, dss_header, body_user)
            lead, patterns = check_lead_settings(
                row.lead_updates if isinstance(lead_updates, _Keep) else lead_updates,
                list(row.volatile_patterns or ())
                if isinstance(volatile_patterns, _Keep)
                else volatile_patterns,
            )
            row.user_headers, row.session_header = list(users), session
            row.lead_updates, row.volatile_patterns = lead, patterns or None
            row.trust_dss_user_header, row.trust_body_user = dss_header, body_user
            now = _settings(row)
            if now != was:
                record(db, actor, AuditAction.FRONTEND_CHANGED, name, {"before": was, "after": now})
            return _frontend(row)

    def _keys_under(self, prefix: str) -> bool:
        starts = func.substr(ApiKeyRow.user_id, 1, len(prefix)) == prefix
        with transaction(self._sf) as db:
            return db.scalar(select(ApiKeyRow.id).where(starts).limit(1)) is not None


def _frontend(row: FrontendRow) -> Frontend:
    created = aware(row.created_at)
    return Frontend(
        row.name,
        tuple(row.user_headers),
        row.session_header,
        created,
        row.created_by,
        row.lead_updates,
        tuple(row.volatile_patterns or ()),
        bool(row.trust_dss_user_header),
        bool(row.trust_body_user),
    )


def _settings(row: FrontendRow) -> dict[str, object]:
    return {
        "user_headers": list(row.user_headers),
        "session_header": row.session_header,
        "lead_updates": row.lead_updates,
        "volatile_patterns": list(row.volatile_patterns or ()),
        "trust_dss_user_header": bool(row.trust_dss_user_header),
        "trust_body_user": bool(row.trust_body_user),
    }


def check_lead_settings(
    lead_updates: str | None, volatile_patterns: Sequence[str]
) -> tuple[str | None, list[str]]:
    """A frontend's lead-update mode (None: the server's) and patterns, checked (`InvalidInput`)."""
    return (
        None if lead_updates is None else check_mode(lead_updates),
        check_patterns(list(volatile_patterns)),
    )
