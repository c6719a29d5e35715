"""Which end user a frontend key's request acts for.

A frontend key (`api.keys.frontends`) acts for the frontend's end users; each request names its
own. The sources, in this order: the `X-DSS-User` header, the frontend's trusted headers (its
`user_headers`, in their order), the body's `user`, then its `safety_identifier` (the body's
fields only on routes whose body has them: they are read after the body, the headers before).
`X-DSS-User` and the body's fields count only where the frontend trusts them
(`trust_dss_user_header`, `trust_body_user`); sent where it does not, they are an
`EndUserSourceNotTrusted` naming the header or field, never silently ignored: a frontend that
forwards what its end users send turns them off, and then an end user naming someone there is
told no rather than served as themself while believing otherwise.

Rules: every source present must name the same end user, else `EndUserConflict` naming two that
differ; none present on a route that acts for a user is `EndUserRequired`, whose message names
what to send. A header is read once and as UTF-8 (`api.headers.single_value`): sent twice, or as
a comma-separated list, it is a `RepeatedHeader`, since behind a proxy that appends its own line
the first value is the client's. The request is refused rather than served as one user shared by all the
frontend's people: that user would pool everyone into one cache namespace, one quota and one
erasure. A blank value counts as absent. The end user must be a user id (`InvalidUserId` naming
its source otherwise); end user `alice` of frontend `webui` is the DSS user `webui/alice`.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers

from api.auth import Caller, FrontendAccess, Principal
from api.headers import USER_HEADER, single_value
from api.http_errors import EndUserConflict, EndUserRequired, EndUserSourceNotTrusted
from api.keys.frontends import end_user_id

BODY_USER = "user"
BODY_SAFETY_IDENTIFIER = "safety_identifier"


def end_user_principal(
    caller: Caller,
    headers: Headers,
    body: Mapping[str, str | None] | None = None,
) -> Principal:
    """The principal a frontend key's request acts for. `body` holds the route's body fields
    that may name the end user (`user`, `safety_identifier`); None on a route without them."""
    frontend = caller.frontend
    assert frontend is not None, "a frontend key's caller"
    found = _sources(frontend, headers, body or {})
    if not found:
        raise EndUserRequired(_required_message(frontend, body is not None))
    (_, first, end_user), *rest = found
    for param, source, other in rest:
        if other != end_user:
            raise EndUserConflict(
                f"{first} and {source} name different end users; send one, or the same in each",
                param=param,
            )
    return Principal(
        end_user_id(frontend.name, end_user, first),
        is_admin=False,
        key_id=caller.key_id,
        session_header=frontend.session_header,
    )


def _sources(
    frontend: FrontendAccess, headers: Headers, body: Mapping[str, str | None]
) -> list[tuple[str, str, str]]:
    """(param, how a message names it, value) of each source present, in the order above."""
    found: list[tuple[str, str, str]] = []
    for name in (USER_HEADER, *frontend.user_headers):
        value = single_value(headers, name)
        if value is not None and value.strip():
            if name == USER_HEADER and not frontend.trust_dss_user_header:
                raise EndUserSourceNotTrusted(_untrusted(frontend, f"the {name} header"), param=name)
            found.append((name, f"the {name} header", value))
    for field in (BODY_USER, BODY_SAFETY_IDENTIFIER):
        value = body.get(field)
        if value is not None and value.strip():
            if not frontend.trust_body_user:
                raise EndUserSourceNotTrusted(_untrusted(frontend, f"the body's `{field}`"), param=field)
            found.append((field, f"the body's {field}", value))
    return found


def _untrusted(frontend: FrontendAccess, source: str) -> str:
    return (
        f"the frontend {frontend.name!r} does not take the end user from {source}: leave it out and "
        "name the end user in " + ", or ".join(_ways(frontend, body_read=True))
    )


def _ways(frontend: FrontendAccess, body_read: bool) -> list[str]:
    headers = (*((USER_HEADER,) if frontend.trust_dss_user_header else ()), *frontend.user_headers)
    ways = [f"the {h} header" for h in headers]
    if body_read and frontend.trust_body_user:
        ways += [f"the body's `{BODY_USER}` (or `{BODY_SAFETY_IDENTIFIER}`) field"]
    return ways


def _required_message(frontend: FrontendAccess, body_read: bool) -> str:
    # Only the body trusted: routes that read no body cannot act for an end user of this frontend.
    ways = _ways(frontend, body_read) or [
        f"the body's `{BODY_USER}` field, which only chat completions, stateful messages and Responses read"
    ]
    return (
        f"this key acts for the end users of the frontend {frontend.name!r}: name the end user in "
        + ", or ".join(ways)
    )
