"""FastAPI dependencies as `Annotated` aliases: the server state, the caller, the engine."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import Scope

from api.auth import KEY_PREFIX, Principal, bearer_token, check_user_name
from api.errors import EngineUnavailable, Forbidden, ServerStarting, SessionIdConflict, Unauthorized
from api.shapes.schemas import NAME_PATTERN
from api.state import AppState, Phase, Startup
from dss.errors import InvalidInput
from dss.inputs import check_text, check_user_id
from dss.store import Store
from dss.types import SessionId

if TYPE_CHECKING:
    from api.llm.chat_engine import ChatEngine

DEV_USER_HEADER = "X-DSS-User"
# The session id as a header, for a router that hashes on it (a body is costly to parse there).
SESSION_HEADER = "X-DSS-Session"

_bearer = HTTPBearer(auto_error=False, description="An API key made by `dss keys create`")


NO_KEY_YET = (
    "this server has no API key yet: create one with `dss keys create --user NAME` "
    "(or run `dss serve --dev` on loopback for local development without keys)"
)


# In a UTF-8 JSON body a NUL or a surrogate can only be an escape (JSON text holds no raw control
# character) or, for a surrogate, its three bytes (`json.loads` decodes bytes with
# "surrogatepass"): a UTF-8 body without either is not walked. Other encodings (UTF-16, UTF-32,
# which json also reads) always are.
_SUSPECT_TEXT = re.compile(rb"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})|\xed[\xa0-\xbf]")
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_WALK_ON_LOOP_MAX_BYTES = 256 << 10


def _may_hold_bad_text(body: bytes) -> bool:
    if b"\x00" in body or body.startswith(_UTF16_BOMS):  # not UTF-8
        return True
    return _SUSPECT_TEXT.search(body) is not None


async def check_request_text(request: Request) -> None:
    """Every request's text, before its route runs (an app-wide dependency): the path parameters,
    the query and the JSON body hold no NUL and no lone surrogate (`dss.inputs.check_text`). One
    check for every route: PostgreSQL refuses such text with a `DataError` deep inside a
    transaction, SQLite keeps it.

    The body is the one FastAPI has already read and parsed for the route (`Request` caches both),
    and it is walked only when its bytes may hold such text."""
    check_text(request.path_params, "path")
    query = request.query_params
    if query:
        check_text({k: query.getlist(k) for k in query}, "query")
    route = request.scope.get("route")
    if isinstance(route, APIRoute) and route.body_field is not None:  # else FastAPI reads none
        body = await request.body()
        if body and _may_hold_bad_text(body):
            try:
                parsed = await request.json()
            except (ValueError, RecursionError):  # not JSON (for FastAPI either): its 400 answers
                return
            if len(body) > _WALK_ON_LOOP_MAX_BYTES:  # ~15 ms per MB of JSON: not on the event loop
                await run_in_threadpool(check_text, parsed, "body")
            else:
                check_text(parsed, "body")


async def get_state(request: Request) -> AppState:
    # async (it does no I/O): a plain `def` dependency costs every request a trip through the
    # thread pool and back, which on a loaded 2-core machine is milliseconds each way.
    state: AppState | None = getattr(request.app.state, "dss", None)
    if state is None:  # listening already, the store still opening (or it failed to)
        startup: Startup = request.app.state.startup
        raise ServerStarting(f"the server is not ready: {startup.reason}")
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def get_store(state: StateDep) -> Store:
    return state.store


StoreDep = Annotated[Store, Depends(get_store)]


# Where `authenticate_before_body` leaves the principal it found, for `get_principal`.
_PRINCIPAL_KEY = "dss_principal"


async def get_principal(
    request: Request,
    state: StateDep,
    _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],  # for the OpenAPI schema
) -> Principal:
    """The caller: the one `authenticate_before_body` found (a request with a body), else from
    the headers here, the same way."""
    early = getattr(request.state, _PRINCIPAL_KEY, None)
    if isinstance(early, Principal):
        return early
    return await _authenticate(state, request)


async def authenticate_before_body(scope: Scope) -> None:
    """`Unauthorized` (or `ServerStarting`) for a request whose headers do not authenticate it,
    decided before any of its body is read (`api.middleware.AuthBeforeBody`): FastAPI reads and
    parses a body before the route's dependencies run, so without this an unauthenticated client
    could make the event loop parse megabytes of JSON per request. The principal found is kept
    in the request's state for `get_principal`."""
    request = Request(scope)  # headers only: nothing here receives the body
    principal = await _authenticate(await get_state(request), request)
    setattr(request.state, _PRINCIPAL_KEY, principal)


async def _authenticate(state: AppState, request: Request) -> Principal:
    """A key validated within the cache's lifetime is answered here on the event loop (a hash
    and a dictionary look-up); anything that may read the database runs in a thread."""
    token = bearer_token(request.headers.get("authorization"))
    if token is not None and token.startswith(KEY_PREFIX):
        hit = state.keys.cached(token)
        if hit is not None:
            return hit
    return await run_in_threadpool(_principal, state, token, request.headers.get(DEV_USER_HEADER))


def _principal(state: AppState, token: str | None, dev_user: str | None) -> Principal:
    if state.dev_mode and (token is None or not token.startswith(KEY_PREFIX)):
        # No DSS key: the openai client always sends some api_key, so a placeholder ("dev", an
        # OPENAI_API_KEY) means "no key" here. A `dss-` token is checked below: a typo or a
        # revoked key must fail, not quietly turn into an admin.
        user = dev_user or state.settings.auth.dev_default_user
        check_user_id(user)  # malformed: a 400 (`InvalidUserId`) that names the rule
        try:
            return Principal(check_user_name(user), is_admin=True, key_id=None, dev_mode=True)
        except InvalidInput as exc:  # the admin's name: not an identity this caller may take
            raise Unauthorized(f"{DEV_USER_HEADER}: {exc}") from None
    if token is None:
        raise Unauthorized() if state.keys.any_active() else Unauthorized(NO_KEY_YET)
    principal = state.keys.authenticate(token)
    if principal is None:
        if state.dev_mode:
            raise Unauthorized(
                f"invalid or revoked API key (development mode checks {KEY_PREFIX} tokens; send none "
                f"to act as the {DEV_USER_HEADER} user)"
            )
        if not state.keys.any_active():
            raise Unauthorized(NO_KEY_YET)
        raise Unauthorized("invalid or revoked API key")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this needs an admin key")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


def acting_principal(request: Request, principal: Principal, body_user: str | None) -> Principal:
    """In development mode a request's `user` field names the user (the header wins if both).

    With API keys the `user` field is what OpenAI makes it: a free tag, never an identity.
    """
    if principal.dev_mode and body_user and DEV_USER_HEADER not in request.headers:
        return principal.as_user(body_user)
    return principal


async def get_engine(request: Request, state: StateDep) -> ChatEngine:
    if state.engine is None:
        startup: Startup = request.app.state.startup
        # The same Retry-After as an overload (`engine.retry_after_s`): one documented value.
        retry = {"Retry-After": str(state.settings.engine.retry_after_s)}
        if not state.settings.engine.enabled:
            raise EngineUnavailable("the engine is disabled on this server", headers=retry)
        if startup.phase is Phase.FAILED:  # the server is stopping: nothing to retry here
            raise EngineUnavailable(f"the engine is not running: {startup.reason}")
        raise EngineUnavailable("the engine is starting", headers=retry)
    return state.engine


EngineDep = Annotated["ChatEngine", Depends(get_engine)]


SessionHeaderDep = Annotated[
    str | None,
    Header(
        alias=SESSION_HEADER,
        pattern=NAME_PATTERN,
        description="The session id, as the body's `session_id` (which wins when only it is given); a "
        "router hashes on this header to keep a session on one server. Both given and different: 400.",
    ),
]


def session_id_of(body_value: str | None, header: str | None) -> SessionId | None:
    """The request's session: the body's `session_id`, else the `X-DSS-Session` header (both
    validated alike, by the schema and the header's pattern); the same value in both is fine,
    two different ones are a `SessionIdConflict`."""
    if header is None or body_value == header:
        return SessionId(body_value) if body_value is not None else None
    if body_value is None:
        return SessionId(header)
    raise SessionIdConflict(
        f"the {SESSION_HEADER} header and the body's session_id name different sessions; send one, "
        "or the same in both"
    )
