"""FastAPI dependencies as `Annotated` aliases: the server state, the caller and who it acts as,
the engine, the session a request names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.types import Scope

from api.auth import Caller, Principal, bearer_token, check_user_name
from api.end_users import BODY_SAFETY_IDENTIFIER, BODY_USER, end_user_principal
from api.headers import ROUTE_HEADER, SESSION_HEADER, USER_HEADER, VLLM_SESSION_HEADER, single_value
from api.http_errors import (
    BadRequest,
    EngineUnavailable,
    Forbidden,
    ServerStarting,
    SessionIdConflict,
    Unauthorized,
)
from api.keys.api_keys import KEY_PREFIX
from api.shapes.schemas import NAME_PATTERN
from api.state import AppState, Phase, Startup
from dss.dialogue.route_keys import checked_route_key
from dss.errors import InvalidInput, InvalidSessionId
from dss.inputs import check_session_id, check_text, check_user_id
from dss.store import Store
from dss.types import SessionId

if TYPE_CHECKING:
    from api.llm.chat_engine import ChatEngine

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


# Where `authenticate_before_body` leaves the caller it found, for `get_caller`.
_CALLER_KEY = "dss_caller"


async def get_caller(
    request: Request,
    state: StateDep,
    _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],  # for the OpenAPI schema
) -> Caller:
    """Who holds the request's credentials: the caller `authenticate_before_body` found (a
    request with a body), else from the headers here, the same way."""
    early = getattr(request.state, _CALLER_KEY, None)
    if isinstance(early, Caller):
        return early
    return await _authenticate(state, request)


CallerDep = Annotated[Caller, Depends(get_caller)]


async def get_principal(request: Request, caller: CallerDep) -> Principal:
    """Who the request acts as, on a route that acts for a user and reads no body field naming
    one: the caller's user, or on a frontend key the end user its headers name (`api.end_users`;
    400 `end_user_required` when they name none)."""
    if caller.frontend is not None:
        return end_user_principal(caller, request.headers)
    return caller.as_principal()


async def authenticate_before_body(scope: Scope) -> None:
    """`Unauthorized` (or `ServerStarting`) for a request whose headers do not authenticate it,
    decided before any of its body is read (`api.middleware.AuthBeforeBody`): FastAPI reads and
    parses a body before the route's dependencies run, so without this an unauthenticated client
    could make the event loop parse megabytes of JSON per request. The caller found is kept in
    the request's state for `get_caller`; a frontend key's end user is resolved later, by the
    route (it may come from the body)."""
    request = Request(scope)  # headers only: nothing here receives the body
    caller = await _authenticate(await get_state(request), request)
    setattr(request.state, _CALLER_KEY, caller)


async def _authenticate(state: AppState, request: Request) -> Caller:
    """A key validated within the cache's lifetime is answered here on the event loop (a hash
    and a dictionary look-up); anything that may read the database runs in a thread."""
    token = bearer_token(request.headers.get("authorization"))
    if token is not None and token.startswith(KEY_PREFIX):
        hit = state.keys.cached(token)
        if hit is not None:
            return hit
    return await run_in_threadpool(_caller, state, token, request.headers)


def _caller(state: AppState, token: str | None, headers: Headers) -> Caller:
    if state.dev_mode and (token is None or not token.startswith(KEY_PREFIX)):
        # No DSS key: the openai client always sends some api_key, so a placeholder ("dev", an
        # OPENAI_API_KEY) means "no key" here. A `dss-` token is checked below: a typo or a
        # revoked key must fail, not quietly turn into an admin.
        user = single_value(headers, USER_HEADER) or state.settings.auth.dev_default_user
        check_user_id(user)  # malformed: a 400 (`InvalidUserId`) that names the rule
        try:
            return Caller(check_user_name(user), is_admin=True, key_id=None, dev_mode=True)
        except InvalidInput as exc:  # the admin's name: not an identity this caller may take
            raise Unauthorized(f"{USER_HEADER}: {exc}") from None
    if token is None:
        raise Unauthorized() if state.keys.any_active() else Unauthorized(NO_KEY_YET)
    caller = state.keys.authenticate(token)
    if caller is None:
        if state.dev_mode:
            raise Unauthorized(
                f"invalid or revoked API key (development mode checks {KEY_PREFIX} tokens; send none "
                f"to act as the {USER_HEADER} user)"
            )
        if not state.keys.any_active():
            raise Unauthorized(NO_KEY_YET)
        raise Unauthorized("invalid or revoked API key")
    return caller


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_admin(caller: CallerDep) -> Caller:
    if not caller.is_admin:
        raise Forbidden("this needs an admin key")
    return caller


AdminDep = Annotated[Caller, Depends(require_admin)]


def acting_principal(
    request: Request, caller: Caller, body_user: str | None, safety_identifier: str | None = None
) -> Principal:
    """Who a request whose body may name a user acts as.

    A frontend key: the end user named by its headers or these body fields (`api.end_users`).
    Development mode: the request's `user` field names the user (the header wins if both).
    A user or admin key: its own user; the `user` field is then what OpenAI makes it, a free
    tag, never an identity.
    """
    if caller.frontend is not None:
        body = {BODY_USER: body_user, BODY_SAFETY_IDENTIFIER: safety_identifier}
        return end_user_principal(caller, request.headers, body)
    principal = caller.as_principal()
    if principal.dev_mode and body_user and USER_HEADER not in request.headers:
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
        "router hashes on this header to keep a session on one server. Two sources that differ: 400.",
    ),
]
VllmSessionHeaderDep = Annotated[
    str | None,
    Header(
        alias=VLLM_SESSION_HEADER,
        pattern=NAME_PATTERN,
        description="vLLM's name for the session id header: the same as X-DSS-Session.",
    ),
]


@dataclass(frozen=True, slots=True)
class SessionHeaders:
    """The session ids a request's headers name, by header: DSS's and vLLM's (validated by
    FastAPI, `param` the header), and the request's headers for a frontend's own."""

    named: tuple[tuple[str, str], ...]
    headers: Headers


async def get_session_headers(
    request: Request, dss: SessionHeaderDep = None, vllm: VllmSessionHeaderDep = None
) -> SessionHeaders:
    # FastAPI validated the first line of each; a second is a `RepeatedHeader`, not ignored.
    for header in (SESSION_HEADER, VLLM_SESSION_HEADER):
        single_value(request.headers, header)
    named = tuple((h, v) for h, v in ((SESSION_HEADER, dss), (VLLM_SESSION_HEADER, vllm)) if v is not None)
    return SessionHeaders(named, request.headers)


SessionHeadersDep = Annotated[SessionHeaders, Depends(get_session_headers)]


def request_route_key(request: Request) -> str | None:
    """The route key the router hashed this request on (`X-DSS-Route`, set by deploy/haproxy.cfg
    on requests that start a response chain or a conversation), None when absent or not one
    (`dss.dialogue.route_keys`: only 16 lowercase hex digits; anything else is ignored, it only
    chooses where later requests go)."""
    values = request.headers.getlist(ROUTE_HEADER)
    return checked_route_key(values[0]) if len(values) == 1 else None


def session_id_of(body_value: str | None, headers: SessionHeaders, principal: Principal) -> SessionId | None:
    """The request's session: the body's `session_id`, the `X-DSS-Session` or `X-Session-ID`
    header, or the frontend's session header (a frontend key's); each validated alike (a bad
    header is a 400 whose `param` names it). Any two that differ are a `SessionIdConflict`."""
    found: list[tuple[str, str]] = [("the body's session_id", body_value)] if body_value is not None else []
    found += [(f"the {h} header", v) for h, v in headers.named]
    if principal.session_header is not None:
        value = single_value(headers.headers, principal.session_header)
        if value is not None:
            try:
                check_session_id(value)
            except InvalidSessionId as exc:
                raise BadRequest(
                    f"{principal.session_header}: {exc}",
                    code="invalid_request",
                    param=principal.session_header,
                ) from None
            found.append((f"the {principal.session_header} header", value))
    if not found:
        return None
    (first, sid), *rest = found
    for source, other in rest:
        if other != sid:
            raise SessionIdConflict(
                f"{first} and {source} name different sessions; send one, or the same in each"
            )
    return SessionId(sid)
