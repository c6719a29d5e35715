"""Walking a session's version tree given its parent map (number -> parent number)."""

from __future__ import annotations

from collections.abc import Mapping

from dss.dialogue.versions.rules import EMPTY_HEAD


def descendants_of(parents: Mapping[int, int | None], root: int) -> list[int]:
    """`root` and every version below it, ascending (so `root` first: children have larger numbers)."""
    inside = [root]
    seen = {root}
    for number in sorted(n for n in parents if n > root):
        if parents[number] in seen:
            inside.append(number)
            seen.add(number)
    return inside


def ancestors_of(parents: Mapping[int, int | None], start: int) -> list[int]:
    """`start` and its ancestors, newest first (parents always have smaller numbers)."""
    out: list[int] = []
    cur: int | None = start
    while cur is not None and cur != EMPTY_HEAD:
        out.append(cur)
        cur = parents[cur]
    return out
