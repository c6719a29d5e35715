"""The version store's input rules and limits: names, sizes, token ids, messages, retention hints,
version numbers. Each raises a typed `InvalidInput`/`LimitExceeded` (or `VersionNotFound`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dss.errors import (
    InvalidInput,
    LimitExceeded,
    VersionNotFound,
)
from dss.tokens import TOKEN_DTYPE
from dss.types import SessionId

INT32_MAX = np.iinfo(np.int32).max
EMPTY_TOKENS = np.zeros(0, dtype=TOKEN_DTYPE)
EMPTY_TOKENS.flags.writeable = False
MAIN_BRANCH = "main"
EMPTY_HEAD = 0
MAX_TOKENS = 1 << 20
MAX_MESSAGES_BYTES = 8 << 20
MAX_METADATA_BYTES = 64 << 10
MAX_SYSTEM_PROMPT_CHARS = 1 << 20
MAX_LIST_LIMIT = 1000
KV_RETENTIONS = ("pinned", "normal", "evict")
MIN_IDLE_TTL_S = 1
MAX_IDLE_TTL_S = 30 * 24 * 3600
NAME_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise InvalidInput(f"{kind} must be 1-128 characters of [A-Za-z0-9._:-], got {name!r}")
    return name


def json_size(kind: str, value: object) -> int:
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{kind} is not JSON-serialisable: {exc}") from exc


def normalised_record(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON record (a version's `seen`) as it comes back from its column; None for an empty one."""
    if not record:
        return None
    try:
        out: dict[str, Any] = json.loads(json.dumps(dict(record)))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"seen is not JSON-serialisable: {exc}") from exc
    return out


def coerce_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidInput("tokens must be a 1-D sequence of token ids")
    if arr.size == 0:
        return EMPTY_TOKENS
    if arr.dtype.kind not in "iu":
        raise InvalidInput(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size > MAX_TOKENS:
        raise LimitExceeded(f"{arr.size} tokens exceed the limit of {MAX_TOKENS}")
    if int(arr.min()) < 0 or int(arr.max()) > INT32_MAX:
        raise InvalidInput("token ids must be in [0, 2**31 - 1]")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list | tuple) or not all(isinstance(m, Mapping) for m in messages):
        raise InvalidInput("messages must be a list of JSON objects")
    plain = [dict(m) for m in messages]
    size = json_size("messages", plain)
    if size > MAX_MESSAGES_BYTES:
        raise LimitExceeded(f"messages take {size} bytes of JSON, over the limit of {MAX_MESSAGES_BYTES}")
    return plain


def normalised(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as they come back from the JSON column, so equality matches stored ones."""
    check_messages(messages)
    out: list[dict[str, Any]] = json.loads(json.dumps([dict(m) for m in messages]))
    return out


def check_retention(kv_retention: str, kv_idle_ttl_s: int | None) -> None:
    """`InvalidInput` unless the hint is one of KV_RETENTIONS and the TTL None or in range."""
    if kv_retention not in KV_RETENTIONS:
        raise InvalidInput(f"kv_retention must be one of {', '.join(KV_RETENTIONS)}, got {kv_retention!r}")
    ttl = kv_idle_ttl_s
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < MIN_IDLE_TTL_S):
        raise InvalidInput(
            f"kv_idle_ttl_s must be an integer of at least {MIN_IDLE_TTL_S} or null, got {ttl!r}"
        )
    if ttl is not None and ttl > MAX_IDLE_TTL_S:
        raise LimitExceeded(f"kv_idle_ttl_s {ttl} exceeds the limit of {MAX_IDLE_TTL_S} s")


MAX_NUMBER = int(INT32_MAX)  # INTEGER columns: a larger number cannot name a stored version


def check_number(number: int, sid: SessionId) -> None:
    """A version number no database column can hold names no version (not a database error)."""
    if not 0 <= number <= MAX_NUMBER:
        raise VersionNotFound(f"version {number} not found in session {sid!r}")
