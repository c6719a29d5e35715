"""Route keys: what the ids DSS mints carry for a router, so that a request naming one reaches
the server that holds its session (docs/operations.md, "Running several servers").

A route key is 16 lowercase hex digits. The ids DSS mints for a client to name later begin with
one, right after their prefix: a response id `resp_<route key><32 hex>`, a conversation id
`conv_<route key><32 hex>`, the session of a response chain `resp-<route key><8 hex>`. The
router (deploy/haproxy.cfg) hashes on the route key it finds in a `previous_response_id`, a
`conversation` or a path, and on a request that starts a chain or a conversation it draws a
random one and passes it in the `X-DSS-Route` header (`api.headers.ROUTE_HEADER`), the one it
hashed on: the id minted there carries it, so every later request naming that id hashes alike.
A response continuing another keeps the chain's key, a response in a conversation the
conversation's.

The ids keep the shape they always had (`resp_`/`conv_` and 48 hex digits): an id minted before
route keys is as valid as before, and its first 16 digits route it like any other (to one server,
though not necessarily the one that answered its first request). What is random in an id is what
follows the route key: 128 bits for response and conversation ids.
"""

from __future__ import annotations

import re
import secrets

ROUTE_KEY_HEX = 16
_ROUTE_KEY_RE = re.compile(r"[0-9a-f]{16}")
# The ids that carry one: their prefix, then the route key.
_ROUTED_ID_RE = re.compile(r"(?:resp_|conv_|resp-)([0-9a-f]{16})[0-9a-f]*")


def new_route_key() -> str:
    return secrets.token_hex(ROUTE_KEY_HEX // 2)


def checked_route_key(value: object) -> str | None:
    """`value` when it is a route key (16 lowercase hex digits), else None."""
    if isinstance(value, str) and _ROUTE_KEY_RE.fullmatch(value) is not None:
        return value
    return None


def route_key_of(minted_id: object) -> str | None:
    """The route key an id DSS minted begins with (a response, conversation or response-chain
    session id), None for any other string."""
    if not isinstance(minted_id, str):
        return None
    m = _ROUTED_ID_RE.fullmatch(minted_id)
    return m.group(1) if m is not None else None


def route_key_for(*candidates: str | None) -> str:
    """The first route key among `candidates` (ids or route keys, in order of precedence), else a
    fresh random one."""
    for c in candidates:
        found = route_key_of(c) or checked_route_key(c)
        if found is not None:
            return found
    return new_route_key()
