"""What the model saw of a version's dialogue, where it differs from what the client sent.

A version stores the client's messages (so the next request's matching works) and the token ids
its KV holds (what the model saw). They differ once a turn was served as a lead update: the ids
start with the lead the history was computed under, and hold the updates stated after it; and
once DSS shortened a dialogue that outgrew the context (`truncation: "auto"`). The `ModelView` is
that difference, small and cumulative: the client messages the model saw in another form
(`replaced`: the stored lead; a user message with a note), the messages it saw in addition
(`inserted`: a late system message before client message i), and the client messages it did not
see (`dropped`: the range [start, end) cut from the front of the history). The continuation rule
(`dss.dialogue.continuation`) renders `seen(messages)`, never the client's messages, so that the
stored ids are checked against what produced them.

Stored as JSON in `versions.seen` (None: the model saw exactly the client's messages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dss.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class ModelView:
    replaced: tuple[tuple[int, dict[str, Any]], ...] = ()
    inserted: tuple[tuple[int, dict[str, Any]], ...] = ()
    dropped: tuple[int, int] | None = None

    @property
    def is_exact(self) -> bool:
        return not self.replaced and not self.inserted and self.dropped is None

    def seen(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The dialogue the model saw for the client's `messages` (which may extend the ones this
        view was recorded for: later messages are seen as sent)."""
        replaced = dict(self.replaced)
        start, end = self.dropped or (0, 0)
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            if start <= i < end:
                continue
            out += [dict(x) for at, x in self.inserted if at == i]
            out.append(dict(replaced.get(i, m)))
        return out

    def replacing(self, at: int, message: Mapping[str, Any]) -> ModelView:
        kept = tuple((i, m) for i, m in self.replaced if i != at)
        replaced = tuple(sorted((*kept, (at, dict(message))), key=lambda e: e[0]))
        return ModelView(replaced, self.inserted, self.dropped)

    def inserting(self, at: int, message: Mapping[str, Any]) -> ModelView:
        return ModelView(self.replaced, (*self.inserted, (at, dict(message))), self.dropped)

    def record(self) -> dict[str, Any] | None:
        """The JSON form stored with a version; None for the exact view."""
        if self.is_exact:
            return None
        out: dict[str, Any] = {
            "replaced": [[i, m] for i, m in self.replaced],
            "inserted": [[i, m] for i, m in self.inserted],
        }
        if self.dropped is not None:
            out["dropped"] = list(self.dropped)
        return out

    @staticmethod
    def of(record: Mapping[str, Any] | None) -> ModelView:
        if not record:
            return ModelView()
        try:
            dropped = record.get("dropped")
            return ModelView(
                tuple((int(i), dict(m)) for i, m in record.get("replaced", ())),
                tuple((int(i), dict(m)) for i, m in record.get("inserted", ())),
                (int(dropped[0]), int(dropped[1])) if dropped else None,
            )
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"a stored model view is malformed: {exc}") from None
