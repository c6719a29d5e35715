"""Bounds on the free-form JSON the store keeps: session metadata, the fields of stored messages
(an assistant's `tool_calls`, ...), a response's items and parameters (`text.format.schema`,
annotations), a public prefix's messages.

Every write path checks its values here BEFORE its transaction, so that no row is committed that
cannot be read back: a value nested a few hundred levels deep is accepted by the JSON column but
breaks every serialiser on the way out (pydantic stops at about 255 levels, Python's `json` at
its recursion limit), which made a user's whole session listing fail. The walk is iterative, so
the check itself cannot overflow the stack however deep its input is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from dss.errors import JsonTooDeep, JsonTooLarge

# A stored value deeper than this cannot be served through the API (pydantic-core's serialiser
# refuses nesting past ~255 levels; a response wraps the value in a few levels of its own).
MAX_SERVABLE_DEPTH = 200
_PATH_SHOWN = 6  # path components an error message names


@dataclass(frozen=True, slots=True)
class JsonLimits:
    """Per stored value: its nesting depth (a scalar is 0, `{}` and `[]` are 1) and its size as
    compact UTF-8 JSON. The API takes them from its limits table (`DSS_LIMITS__MAX_JSON_DEPTH`,
    `DSS_LIMITS__MAX_JSON_BYTES`)."""

    max_depth: int = 32
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= MAX_SERVABLE_DEPTH:
            raise ValueError(f"max_depth must be 1-{MAX_SERVABLE_DEPTH}, got {self.max_depth}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")


def json_depth(value: object, stop_after: int) -> tuple[int, tuple[str, ...]]:
    """The nesting depth of `value` and the path to its deepest container, without recursion;
    the walk stops once a container deeper than `stop_after` is found (that depth is returned)."""
    deepest, where = 0, cast(tuple[str, ...], ())
    stack: list[tuple[object, int, tuple[str, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, Mapping):
            children: Iterable[tuple[str, object]] = ((f".{k}", v) for k, v in node.items())
        elif isinstance(node, list | tuple):
            children = ((f"[{i}]", v) for i, v in enumerate(node))
        else:
            continue
        if depth > deepest:
            deepest, where = depth, path
            if depth > stop_after:
                break
        for step, child in children:
            if isinstance(child, Mapping | list | tuple):
                stack.append((child, depth + 1, (*path, step) if len(path) < _PATH_SHOWN else path))
    return deepest, where


def check_json(field: str, value: object, limits: JsonLimits) -> int:
    """Refuse `value` (named `field` in the error) when it is nested deeper than
    `limits.max_depth` (`JsonTooDeep`) or takes more than `limits.max_bytes` of JSON
    (`JsonTooLarge`); its size in bytes otherwise."""
    depth, path = json_depth(value, limits.max_depth)
    if depth > limits.max_depth:
        at = field + "".join(path) + ("..." if len(path) >= _PATH_SHOWN else "")
        raise JsonTooDeep(
            f"{field} is nested more than {limits.max_depth} levels deep (at {at}); the server's "
            f"limit is max_json_depth={limits.max_depth}",
            field=field,
        )
    try:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise JsonTooLarge(f"{field} is not JSON: {exc}", field=field) from None
    if size > limits.max_bytes:
        raise JsonTooLarge(
            f"{field} takes {size} bytes of JSON, over the server's limit of "
            f"max_json_bytes={limits.max_bytes}",
            field=field,
        )
    return size


def check_items(field: str, items: Iterable[Mapping[str, Any]], limits: JsonLimits) -> None:
    """`check_json` on every structured field of every item of a list of JSON objects (messages,
    response items): each is named `field[i].key`, so the error says which one."""
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue  # the caller's shape check names it
        for key, value in item.items():
            if isinstance(value, Mapping | list | tuple):
                check_json(f"{field}[{i}].{key}", value, limits)


def servable(value: object, limits: JsonLimits) -> bool:
    """Whether a value read back can be served: within the depth limit (a row written before the
    limit existed may not be)."""
    return json_depth(value, limits.max_depth)[0] <= limits.max_depth
