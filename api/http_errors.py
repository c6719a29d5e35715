"""The one place where errors become HTTP responses, in OpenAI's shape.

`{"error": {"message", "type", "param", "code"}}` for every error the server answers: the store's
typed exceptions (`dss.errors`), the API's own (`ApiError` below), request validation (always 400,
malformed JSON included, never FastAPI's 422), unknown routes, and anything unexpected (500,
logged, with no internals in the message; a database error is logged without its message, which
may quote user content).
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dss import errors as e

log = logging.getLogger("dss.api")


class UncachedModel(e.DSSError):
    """DSS cannot cache the configured model or parallel layout, and uncached serving was not
    allowed (`DSS_ENGINE__ALLOW_UNCACHED`): the server refuses to start, with this one line."""


class ApiError(Exception):
    """An error that only exists at the HTTP boundary (auth, admission, engine state)."""

    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or _snake(type(self).__name__)
        self.param = param
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class SessionIdConflict(BadRequest):
    """A request names its session twice or more (the body's `session_id`, the `X-DSS-Session`
    header a router hashes on, vLLM's `X-Session-ID`, a frontend's session header) and two of
    them differ: which one the turn belongs to, and which server it was routed by, would be a
    guess."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="session_id_conflict", param="session_id")


class SessionHeaderOnResponses(BadRequest):
    """`X-DSS-Session` or `X-Session-ID` on `POST /v1/responses`: a response continues the
    dialogue that `previous_response_id` or `conversation` names, never a Chat Completions
    session; ignoring the header would leave a client believing its turns share one session."""

    def __init__(self, header: str) -> None:
        super().__init__(
            f"the {header} header names a Chat Completions session; a response continues "
            "previous_response_id or a conversation (send one of those, and no session header)",
            code="session_header_not_supported",
            param=header,
        )


class EndUserRequired(BadRequest):
    """A frontend key's request on a route that acts for a user names no end user: it is refused
    rather than served as one user shared by all the frontend's people (`api.end_users`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="end_user_required", param="user")


class EndUserConflict(BadRequest):
    """A frontend key's request names two different end users (say a header and the body's
    `user`): which person the turn belongs to would be a guess."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, code="end_user_conflict", param=param)


class EndUserSourceNotTrusted(BadRequest):
    """A frontend key's request names its end user in a source the frontend does not trust
    (`X-DSS-User`, or the body's `user` or `safety_identifier`; `api.keys.frontends`): refused,
    not ignored, so that neither the client nor the frontend believes it was heard."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, code="end_user_source_not_trusted", param=param)


class RepeatedHeader(BadRequest):
    """A header that names who a request acts for or its session (`X-DSS-User`, a frontend's
    user or session header, `X-DSS-Session`, `X-Session-ID`) sent more than once, or holding a
    comma-separated list (several lines folded into one, RFC 9110 section 5.3). Behind a proxy
    that appends its own line, the first value is the client's: taking it would let the client
    act as anyone, taking the last would trust whatever the proxy chain happens to do."""

    def __init__(self, header: str, why: str) -> None:
        super().__init__(
            f"the {header} header {why}: send it once, with one value",
            code="repeated_header",
            param=header,
        )


class HeaderNotUtf8(BadRequest):
    """A header naming a user or a session whose bytes are not UTF-8: DSS reads ids from every
    source as UTF-8 (a body and a path are UTF-8), so that one person is one id whichever way
    a request names them; another decoding would make a second, garbled person."""

    def __init__(self, header: str) -> None:
        super().__init__(
            f"the {header} header is not valid UTF-8: DSS reads user and session ids as UTF-8 bytes",
            code="invalid_header_encoding",
            param=header,
        )


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str = "a valid API key is required (Authorization: Bearer ...)") -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class RateLimited(ApiError):
    """A per-user rate limit (`api.ratelimit`) refused the request; retry after `Retry-After`."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, code="rate_limited", headers={"Retry-After": str(retry_after_s)})


class EngineUnavailable(ApiError):
    """The engine is not running (starting, disabled, or dead)."""

    status = 503
    type = "service_unavailable_error"


class EngineOverloaded(ApiError):
    """Too many generations in flight; the client should retry after `Retry-After` seconds."""

    status = 503
    type = "overloaded_error"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, code="engine_overloaded", headers={"Retry-After": str(retry_after_s)})


class UserSlotsExhausted(ApiError):
    """The user already holds their share of the generation slots (`max_slots_per_user`)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(
            message, code="too_many_user_generations", headers={"Retry-After": str(retry_after_s)}
        )


class ServerStarting(ApiError):
    """The server listens but its store is not open yet (`/readyz` says why)."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message, code="server_starting", headers={"Retry-After": str(retry_after_s)})


class HostNotAllowed(ApiError):
    """Development mode answers only requests addressed to a loopback name: a page on a DNS name
    rebound to 127.0.0.1 must not reach an unauthenticated admin API through the user's browser."""

    status = 421  # Misdirected Request: this server does not serve that host
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="host_not_allowed")


# Most specific first: the first matching class decides.
_STORE_ERRORS: tuple[tuple[type[e.DSSError], int, str], ...] = (
    (e.NotFoundError, 404, "not_found_error"),
    (e.ConflictError, 409, "conflict_error"),
    (e.QuotaExceeded, 429, "rate_limit_error"),
    (e.InvalidInput, 400, "invalid_request_error"),
    (e.CapacityError, 503, "service_unavailable_error"),
    (e.TierUnavailable, 503, "service_unavailable_error"),
    (e.StoreClosed, 503, "service_unavailable_error"),
    # The master key was rotated under this running server: it must be restarted with the new one.
    (e.MasterKeyRotated, 503, "service_unavailable_error"),
    (e.RetentionBusy, 503, "overloaded_error"),
    (e.DSSError, 500, "server_error"),
)

_RETRY_AFTER_503 = {"Retry-After": "1"}


def store_error_status(exc: e.DSSError) -> tuple[int, str]:
    for cls, status, kind in _STORE_ERRORS:
        if isinstance(exc, cls):
            return status, kind
    return 500, "server_error"


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def response_for(exc: BaseException) -> JSONResponse:
    """The response for any exception (also used inside SSE streams, through `error_body`)."""
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)
    if isinstance(exc, e.DSSError):
        status, kind = store_error_status(exc)
        if isinstance(exc, e.RetentionBusy):  # an overload, like `EngineOverloaded`: not a failure
            message = str(exc)
        elif status >= 500:
            # Storage and key failures are logged in full and answered without internals.
            log.error("store error answering a request", exc_info=exc)
            message = "the store failed to serve the request" if status == 500 else str(exc)
        else:
            message = str(exc)
        headers = _RETRY_AFTER_503 if status == 503 else None
        if isinstance(exc, e.QuotaExceeded | e.RetentionBusy):
            headers = {"Retry-After": str(exc.retry_after_s)}
        param = exc.field if isinstance(exc, e.LimitExceeded) else None  # the request field over a limit
        return error_response(status, message, kind, _snake(type(exc).__name__), param, headers)
    if isinstance(exc, OperationalError):
        # The metadata database does not answer (PostgreSQL down or restarting, the connection
        # lost, SQLite locked): as a rule nothing was committed (a connection lost during COMMIT
        # itself may have committed), and the same request can succeed later or on another server.
        # Logged without the statement (it may hold user data).
        log.error("the metadata database failed: %s", type(exc.orig).__name__ if exc.orig else "unknown")
        return error_response(
            503, "the metadata database is unavailable; retry later",
            "service_unavailable_error", "database_unavailable", headers=_RETRY_AFTER_503,
        )  # fmt: skip
    if isinstance(exc, UnicodeEncodeError):  # text with a lone surrogate reached an encoder
        return error_response(
            400, "the request holds text that is not valid Unicode (a lone surrogate)",
            "invalid_request_error", "invalid_unicode",
        )  # fmt: skip
    if isinstance(exc, SQLAlchemyError):
        # Its message, and its driver's (PostgreSQL's DETAIL quotes key values), may hold user
        # content: logged are the kinds and the stack, never a message.
        stack = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
        log.error("database error answering a request: %s\n%s", _db_error_kind(exc), stack)
    else:
        log.error("unhandled error answering a request", exc_info=exc)
    return error_response(500, "internal server error", "server_error", "internal_error")


def _db_error_kind(exc: SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    if orig is None:
        return type(exc).__name__
    state = getattr(orig, "sqlstate", None) or getattr(orig, "sqlite_errorname", None)
    return f"{type(exc).__name__} ({type(orig).__name__}{f', {state}' if state else ''})"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.rstrip("_")).lower()


def _validation_param(errors: list[Any]) -> str | None:
    if not errors:
        return None
    loc = [str(p) for p in errors[0].get("loc", ()) if p not in ("body", "query", "path", "header")]
    return ".".join(loc) or None


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', 'decode error')}"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


async def _on_api_error(_req: Request, exc: Exception) -> JSONResponse:
    return response_for(exc)


async def _on_validation(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(x.get("type") == "json_invalid" for x in errors):
        return error_response(400, _validation_message(errors), "invalid_request_error", "invalid_json")
    code = "invalid_request"
    return error_response(
        400, _validation_message(errors), "invalid_request_error", code, _validation_param(errors)
    )


async def _on_http(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, ApiError):  # raised while FastAPI read the body (size limit)
        return response_for(exc.__cause__)
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
    }
    kind = kinds.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404 and message == "Not Found":
        message = "no such endpoint"
    return error_response(exc.status_code, message, kind, None, headers=dict(exc.headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(e.DSSError, _on_api_error)
    app.add_exception_handler(OperationalError, _on_api_error)  # the database does not answer: 503
    app.add_exception_handler(UnicodeEncodeError, _on_api_error)  # text a database or tokenizer refuses
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_api_error)


# Documented error responses of every route (OpenAPI), so clients and schema tests know them.
def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    from api.shapes.schemas import ErrorResponse

    descriptions = {
        400: "Bad request",
        401: "Missing or invalid API key",
        403: "Not allowed for this key",
        404: "Not found",
        409: "Conflict with the current state",
        413: "Body too large",
        429: "Rate limited (see Retry-After)",
        503: "Engine unavailable or overloaded (see Retry-After)",
    }
    return {s: {"model": ErrorResponse, "description": descriptions.get(s, "Error")} for s in statuses}
