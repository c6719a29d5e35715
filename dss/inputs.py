"""What may enter the store as an id or as text: one rule each, checked where a value enters.

- **User ids** (`check_user_id`): 1-256 characters, not only whitespace, no `/` and no control
  character (C0, DEL, C1; NUL included) nor lone surrogate, and not `.` or `..`. A `/` would make
  the id unreachable as one path segment (`DELETE /v1/users/{id}`), a control character invisible
  in logs and consoles, and `.` or `..` are dot segments that clients remove from URLs (RFC 3986,
  5.2.4), even percent-encoded: `DELETE /v1/users/..` reaches `/v1/`. Frontend names and end-user
  ids follow this rule too. This is the rule for an id someone names for the first time: a new API key, the
  development-mode `X-DSS-User` header and `user` field.
- **Stored user ids** (`check_stored_user_id`): what an earlier version accepted and may have
  stored (`org/alice`, made before the rule above): 1-256 characters, not only whitespace, no NUL
  nor lone surrogate. The store's own calls and the erasure take these, so that every user a
  store holds stays usable by its keys and erasable (`.` and `..` by `DELETE /v1/users?id=..`
  or `dss users erase`).
- **Session ids** (`check_session_id`): 1-128 characters of `[A-Za-z0-9._:-]` (the alphabet since
  the first version), except `.` and `..`, which clients remove from URLs as dot segments
  (RFC 3986, 5.2.4): `GET /v1/sessions/..` reaches `/v1/`. Sessions so named before the rule stay
  readable and deletable by their id.
- **Text** (`check_text`): every string a request carries (path, query, JSON keys and values):
  no NUL (PostgreSQL's text and JSON types cannot hold it; SQLite would keep it and give back
  something PostgreSQL refuses) and no lone surrogate (it has no UTF-8 form).

Each refusal is a typed `InvalidInput` (`InvalidUserId`, `InvalidSessionId`, `InvalidText`,
`InvalidUnicode`) whose message names the rule.
"""

from __future__ import annotations

import re

from dss.errors import InvalidSessionId, InvalidText, InvalidUnicode, InvalidUserId
from dss.types import SessionId, UserId

MAX_USER_ID_CHARS = 256
MAX_SESSION_ID_CHARS = 128
SESSION_ID_ALPHABET = "[A-Za-z0-9._:-]"
DOT_SEGMENTS = frozenset({".", ".."})

_SESSION_ID_RE = re.compile(f"{SESSION_ID_ALPHABET}{{1,{MAX_SESSION_ID_CHARS}}}")
# C0 controls, DEL, C1 controls, and UTF-16 surrogates (only lone ones reach a `str`).
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_BAD_TEXT_RE = re.compile("[\x00\ud800-\udfff]")

USER_ID_RULE = (
    f"a user id is 1-{MAX_USER_ID_CHARS} characters, not only whitespace, without '/' or control characters, "
    "and not '.' or '..'"
)
SESSION_ID_RULE = (
    f"a session id is 1-{MAX_SESSION_ID_CHARS} characters of {SESSION_ID_ALPHABET}, and not '.' or '..'"
)


def check_user_id(user: object) -> UserId:
    """`user` as a `UserId`, or `InvalidUserId` naming the rule it breaks (see the module)."""
    text = _stored_user_id(user)
    if "/" in text:
        raise InvalidUserId(f"{USER_ID_RULE}: {text!r} contains '/'")
    if text in DOT_SEGMENTS:
        raise InvalidUserId(
            f"{USER_ID_RULE}: {text!r} is a dot segment, which clients remove from URLs (RFC 3986)"
        )
    bad = _CONTROL_RE.search(text)
    if bad is not None:
        raise InvalidUserId(
            f"{USER_ID_RULE}: {text!r} contains the control character {_codepoint(bad.group())}"
        )
    return UserId(text)


def check_stored_user_id(user: object) -> UserId:
    """`user` as a `UserId` if an earlier version may have stored it (it may hold `/`), else
    `InvalidUserId`: for naming users that exist, never for making new ones."""
    return UserId(_stored_user_id(user))


def _stored_user_id(user: object) -> str:
    if not isinstance(user, str) or not user.strip():
        raise InvalidUserId(f"{USER_ID_RULE}: got an empty or blank one")
    if len(user) > MAX_USER_ID_CHARS:
        raise InvalidUserId(f"{USER_ID_RULE}: got {len(user)} characters")
    bad = _BAD_TEXT_RE.search(user)
    if bad is not None:
        raise InvalidUserId(f"{USER_ID_RULE}: got one with the control character {_codepoint(bad.group())}")
    return user


def check_session_id(sid: object) -> SessionId:
    """`sid` as a `SessionId` a new session may take, or `InvalidSessionId` naming the rule."""
    if not isinstance(sid, str) or _SESSION_ID_RE.fullmatch(sid) is None:
        shown = repr(sid) if isinstance(sid, str) and len(sid) <= 2 * MAX_SESSION_ID_CHARS else "a longer one"
        raise InvalidSessionId(f"{SESSION_ID_RULE}: got {shown}")
    if sid in DOT_SEGMENTS:
        raise InvalidSessionId(
            f"{SESSION_ID_RULE}: {sid!r} is a dot segment, which clients remove from URLs (RFC 3986)"
        )
    return SessionId(sid)


def check_text(value: object, where: str) -> None:
    """`InvalidText` (`InvalidUnicode`) when a string anywhere in `value` (a JSON-like tree of
    dicts, lists and scalars; dict keys included) holds a NUL (a lone surrogate); `where` names
    the value's place in the request and the message adds the path inside it."""
    if _clean(value):
        return
    # Iterative (a deep tree must not exhaust the recursion limit); a place's path is a linked
    # list of (parent, step) built into text only for the message.
    stack: list[tuple[object, _Place]] = [(value, (None, where))]
    while stack:
        v, place = stack.pop()
        if isinstance(v, str):
            _check_string(v, place)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    _check_string(k, (place, " (a key)"))
                if isinstance(item, str | dict | list):
                    stack.append((item, (place, k)))
        elif isinstance(v, list | tuple):
            stack.extend(
                (item, (place, i)) for i, item in enumerate(v) if isinstance(item, str | dict | list)
            )


_Place = tuple["_Place | None", "str | int"]

_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _clean(value: object) -> bool:
    """True when no string in `value` holds a NUL or a surrogate: the walk of every request,
    kept lean (no places; an ASCII string, the usual kind, is known surrogate-free in O(1)) so
    that it costs less than parsing the JSON did. False: walk again, naming the place."""
    stack = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        v = pop()
        if isinstance(v, str):
            if "\x00" in v or (not v.isascii() and _SURROGATE_RE.search(v) is not None):
                return False
        elif isinstance(v, dict):
            for k in v:
                if isinstance(k, str) and ("\x00" in k or (not k.isascii() and _SURROGATE_RE.search(k))):
                    return False
            extend(v.values())
        elif isinstance(v, list | tuple):
            extend(v)
    return True


def _check_string(text: str, place: _Place) -> None:
    bad = _BAD_TEXT_RE.search(text)
    if bad is None:
        return
    rule = "text must hold no NUL character and no lone surrogate"
    if bad.group() == "\x00":
        raise InvalidText(f"{rule}: {_path(place)} holds a NUL character")
    raise InvalidUnicode(f"{rule}: {_path(place)} holds a lone surrogate (it is not valid Unicode)")


def _path(place: _Place) -> str:
    steps: list[str] = []
    node: _Place | None = place
    while node is not None:
        parent, step = node
        if isinstance(step, int):
            steps.append(f"[{step}]")
        elif parent is None or step == " (a key)":
            steps.append(step)
        else:  # a key: shown without its NULs, and short
            shown = _BAD_TEXT_RE.sub("?", step)
            steps.append("." + (shown if len(shown) <= 40 else shown[:37] + "..."))
        node = parent
    return "".join(reversed(steps))


def _codepoint(ch: str) -> str:
    return f"U+{ord(ch):04X}"
