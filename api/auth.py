"""The identity of a request: who holds its credentials (`Caller`), whom it acts as (`Principal`).

The keys themselves (created, revoked, looked up) are `api.keys.api_keys.ApiKeys`.

Admin keys act as the user `admin`, a name no user key and no development-mode request may take:
a user key made with `--user admin` would otherwise read and erase the admin's sessions.

A frontend key (`--frontend NAME`) acts for the end users of a registered frontend
(`api.keys.frontends`): each request names its end user (`api.end_users`), who is the DSS user
`NAME/<end user>`. Authenticating a key gives a `Caller` (who holds the credentials); the
`Principal` (whose sessions a request uses) is the caller itself, except on a frontend key,
where it is the end user the request names.

Development mode (`dss serve --dev`, loopback only) is a flag of the server, never a fallback:
without it, a server with no key answers every request 401. In development mode a request with
no DSS key (no bearer token, or one not starting with `dss-`, such as the placeholder the openai
client insists on) acts as the user named by `X-DSS-User` (or the request's `user` field) with
admin rights; a `dss-` token is still checked, and acts as its key's owner or is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from api.keys.audit import ACTOR_DEV
from dss.errors import InvalidInput
from dss.inputs import check_user_id
from dss.types import UserId

ADMIN_USER = UserId("admin")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as: the user whose sessions and cache namespace it uses. On a frontend
    key, the end user (`frontend/alice`), with the frontend's session header."""

    user: UserId
    is_admin: bool
    key_id: str | None  # None for a development-mode identity
    dev_mode: bool = False
    session_header: str | None = None  # the frontend's header naming the session, if any

    def as_user(self, user: str) -> Principal:
        """Development mode only: act as another user named by the request."""
        return replace(self, user=check_user_name(user))


@dataclass(frozen=True, slots=True)
class FrontendAccess:
    """What a frontend key trusts (`api.keys.frontends.Frontend`, as cached with the key)."""

    name: str
    user_headers: tuple[str, ...]
    session_header: str | None
    lead_updates: str | None = None  # None: the server's setting
    volatile_patterns: tuple[str, ...] = ()
    trust_dss_user_header: bool = True  # the end user may come from X-DSS-User
    trust_body_user: bool = True  # ... and from the body's `user` and `safety_identifier`


@dataclass(frozen=True, slots=True)
class Caller:
    """Who holds a request's credentials: a user or admin key (acting as `user`), development
    mode's identity, or a frontend key (`user` None: it acts for the end user each request names)."""

    user: UserId | None
    is_admin: bool
    key_id: str | None
    dev_mode: bool = False
    frontend: FrontendAccess | None = None

    def as_principal(self) -> Principal:
        """The principal of a key that acts as one user (not a frontend key's)."""
        if self.user is None:
            raise ValueError("a frontend key acts for the end user its request names")
        return Principal(self.user, self.is_admin, self.key_id, self.dev_mode)

    @property
    def actor(self) -> str:
        """How the audit trail names this caller."""
        return self.key_id or ACTOR_DEV


def check_user_name(user: str) -> UserId:
    """A user id a user may take (a new key, development mode's header or `user` field): one of
    the alphabet (`dss.inputs.check_user_id`, else `InvalidUserId`) except the admin keys' own
    (`InvalidInput`)."""
    check_user_id(user)
    if user == ADMIN_USER:
        raise InvalidInput(f"the user id {ADMIN_USER!r} is reserved for admin keys")
    return UserId(user)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
