"""The campaign's two custom schemathesis checks, registered when schemathesis imports this module
(`SCHEMATHESIS_HOOKS=_fuzz.hooks`, bench/ on PYTHONPATH; `runs.HOOKS_MODULE`):
`session_availability` (schemathesis' `ensure_resource_availability` minus the documented 404 of
a branch or version a generated body names) and `acknowledged_version_readable` (a version a turn
acknowledged, a response stored, is readable at once through its link)."""

from __future__ import annotations

import contextlib
from typing import Any

from _fuzz.links import RESPONSE, RESPONSES, VERSION


def _error_code(response: Any) -> str | None:
    with contextlib.suppress(Exception):
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
            return str(code) if code is not None else None
    return None


def _register_checks() -> None:
    """The custom checks, registered when schemathesis imports this file (SCHEMATHESIS_HOOKS)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import ensure_resource_availability

    @schemathesis.check
    def session_availability(ctx: Any, response: Any, case: Any) -> bool | None:
        """schemathesis' `ensure_resource_availability` (a session just created must be found),
        except for the documented 404 of a *branch* or *version* that a generated body names
        inside an existing session (`branch_not_found`, `version_not_found`): the session is there."""
        if response.status_code != 404 or _error_code(response) in ("branch_not_found", "version_not_found"):
            return None
        result: bool | None = ensure_resource_availability(ctx, response, case)
        return result

    @schemathesis.check
    def acknowledged_version_readable(ctx: Any, response: Any, case: Any) -> bool | None:
        """A turn the server acknowledged (200 with `state_version`) must be readable right after
        through the link to `GET /v1/sessions/{sid}/versions/{state_version}`; a stored response
        (200 from `POST /v1/responses` without `store: false`) through `GET /v1/responses/{id}`."""
        if response.status_code != 404 or case.operation.path not in (VERSION[1], RESPONSE[1]):
            return None
        if case.operation.path == RESPONSE[1]:
            return _stored_response_readable(ctx, response, case)
        internals = getattr(ctx, "internals", None)
        if internals is None:
            return None
        parent = internals.find_parent(case_id=case.id)
        parent_response = internals.find_response(case_id=parent.id) if parent is not None else None
        if parent_response is None or parent_response.status_code != 200:
            return None
        with contextlib.suppress(Exception):
            body = parent_response.json()
            params = case.path_parameters or {}
            if (
                isinstance(body, dict)
                and body.get("session_id") == params.get("session_id")
                and body.get("state_version") == params.get("number")
            ):
                raise AssertionError(
                    f"{parent.operation.label} acknowledged version {body['state_version']} of session "
                    f"{body['session_id']!r}, but reading it answers 404: {response.text[:300]}"
                )
        return None


def _stored_response_readable(ctx: Any, response: Any, case: Any) -> None:
    internals = getattr(ctx, "internals", None)
    if internals is None:
        return
    parent = internals.find_parent(case_id=case.id)
    parent_response = internals.find_response(case_id=parent.id) if parent is not None else None
    if parent is None or parent_response is None or parent_response.status_code != 200:
        return
    if parent.operation.path != RESPONSES[1]:
        return
    body: Any = None
    with contextlib.suppress(ValueError):
        body = parent_response.json()
    sent = parent.body if isinstance(parent.body, dict) else {}
    asked = (case.path_parameters or {}).get("response_id")
    if isinstance(body, dict) and sent.get("store", True) is not False and body.get("id") == asked:
        raise AssertionError(
            f"response {asked!r} was stored, but reading it answers 404: {response.text[:300]}"
        )


_register_checks()
