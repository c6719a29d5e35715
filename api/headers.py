"""The request headers DSS itself reads, by name (HTTP header names are case-insensitive).

A frontend may add its own: the headers its keys trust to name the end user and the session
(`api.keys.frontends`); those may not reuse these names nor the reserved ones below.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from api.http_errors import HeaderNotUtf8, RepeatedHeader

# The user: in development mode, who a request acts as; on a frontend key, the end user.
USER_HEADER = "X-DSS-User"
# The session id as a header, for a router that hashes on it (a body is costly to parse there).
SESSION_HEADER = "X-DSS-Session"
# vLLM's name for the same (`vllm/entrypoints/generate/base/serving.py`, `SESSION_ID_HEADER`).
VLLM_SESSION_HEADER = "X-Session-ID"
# Set by the router (deploy/haproxy.cfg) on a request that may mint an id a later request names
# (a response, a conversation): the route key it hashed on, which the id then carries
# (`dss.dialogue.route_keys`). Anything but 16 lowercase hex digits is ignored.
ROUTE_HEADER = "X-DSS-Route"

DSS_HEADERS = frozenset(h.lower() for h in (USER_HEADER, SESSION_HEADER, VLLM_SESSION_HEADER, ROUTE_HEADER))
# Headers that carry credentials or framing: never an end user's or a session's name.
RESERVED_HEADERS = frozenset(
    {"authorization", "cookie", "host", "content-type", "content-length", "transfer-encoding"}
)


def single_value(headers: Headers, name: str) -> str | None:
    """The one value of the header `name` as UTF-8 text, None when it is absent.

    For the headers that name who a request acts for or its session: `RepeatedHeader` when the
    request sends it on two lines or as a comma-separated list (a proxy may fold lines into one,
    RFC 9110 section 5.3), `HeaderNotUtf8` when its bytes are not UTF-8. The ASGI server hands
    header bytes over as Latin-1 text; re-encoding gives the bytes back exactly, so `josé` sent
    as UTF-8 is the same id as the body's or the path's `josé`."""
    values = headers.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise RepeatedHeader(name, f"is sent {len(values)} times")
    try:
        value = values[0].encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:  # (Latin-1 encodes whatever it decoded: only UTF-8 can fail)
        raise HeaderNotUtf8(name) from None
    if "," in value:
        raise RepeatedHeader(name, "holds a comma-separated list (lines folded into one)")
    return value
