"""FastAPI dependencies as `Annotated` aliases: the server state, the caller, the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.auth import Principal, check_user_id
from api.errors import EngineUnavailable, Forbidden, Unauthorized
from api.state import AppState
from dss.errors import InvalidInput
from dss.store import Store
from dss.types import UserId

if TYPE_CHECKING:
    from api.engine import ChatEngine

DEV_USER_HEADER = "X-DSS-User"

_bearer = HTTPBearer(auto_error=False, description="An API key made by `dss keys create`")


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.dss
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_store(state: StateDep) -> Store:
    return state.store


StoreDep = Annotated[Store, Depends(get_store)]


def get_principal(
    request: Request,
    state: StateDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if state.dev_mode:
        # Development mode ignores Authorization (the openai client always sends one).
        user = request.headers.get(DEV_USER_HEADER) or state.settings.auth.dev_default_user
        try:
            return Principal(UserId(check_user_id(user)), is_admin=True, key_id=None, dev_mode=True)
        except InvalidInput as exc:
            raise Unauthorized(f"{DEV_USER_HEADER}: {exc}") from None
    if credentials is None:
        raise Unauthorized()
    principal = state.keys.authenticate(credentials.credentials)
    if principal is None:
        raise Unauthorized("invalid or revoked API key")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_admin(principal: PrincipalDep) -> Principal:
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


def get_engine(state: StateDep) -> ChatEngine:
    if state.engine is None:
        enabled = state.settings.engine.enabled
        reason = "the engine is starting" if enabled else "the engine is disabled on this server"
        raise EngineUnavailable(reason, headers={"Retry-After": "5"})
    return state.engine


EngineDep = Annotated["ChatEngine", Depends(get_engine)]
