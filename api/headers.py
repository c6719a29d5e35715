"""The request headers DSS itself reads, by name (HTTP header names are case-insensitive).

A frontend may add its own: the headers its keys trust to name the end user and the session
(`api.keys.frontends`); those may not reuse these names nor the reserved ones below.
"""

from __future__ import annotations

# The user: in development mode, who a request acts as; on a frontend key, the end user.
USER_HEADER = "X-DSS-User"
# The session id as a header, for a router that hashes on it (a body is costly to parse there).
SESSION_HEADER = "X-DSS-Session"
# vLLM's name for the same (`vllm/entrypoints/generate/base/serving.py`, `SESSION_ID_HEADER`).
VLLM_SESSION_HEADER = "X-Session-ID"

DSS_HEADERS = frozenset(h.lower() for h in (USER_HEADER, SESSION_HEADER, VLLM_SESSION_HEADER))
# Headers that carry credentials or framing: never an end user's or a session's name.
RESERVED_HEADERS = frozenset(
    {"authorization", "cookie", "host", "content-type", "content-length", "transfer-encoding"}
)
