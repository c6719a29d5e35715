"""What the model saw of a version's dialogue, where it differs from what the client sent.

A version stores the client's messages (so the next request's matching works) and the token ids
its KV holds (what the model saw). They differ once a turn was served as a lead update: the ids
start with the lead the history was computed under, and hold the updates stated after it. The
`ModelView` is that difference, small and cumulative: the client messages the model saw in
another form (`replaced`: the stored lead; a user message with a note), and the messages it saw
in addition (`inserted`: a late system message before client message i). The continuation rule
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

    @property
    def is_exact(self) -> bool:
        return not self.replaced and not self.inserted

    def seen(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The dialogue the model saw for the client's `messages` (which may extend the ones this
        view was recorded for: later messages are seen as sent)."""
        replaced = dict(self.replaced)
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            out += [dict(x) for at, x in self.inserted if at == i]
            out.append(dict(replaced.get(i, m)))
        return out

    def replacing(self, at: int, message: Mapping[str, Any]) -> ModelView:
        kept = tuple((i, m) for i, m in self.replaced if i != at)
        return ModelView(tuple(sorted((*kept, (at, dict(message))), key=lambda e: e[0])), self.inserted)

    def inserting(self, at: int, message: Mapping[str, Any]) -> ModelView:
        return ModelView(self.replaced, (*self.inserted, (at, dict(message))))

    def record(self) -> dict[str, Any] | None:
        """The JSON form stored with a version; None for the exact view."""
        if self.is_exact:
            return None
        return {
            "replaced": [[i, m] for i, m in self.replaced],
            "inserted": [[i, m] for i, m in self.inserted],
        }

    @staticmethod
    def of(record: Mapping[str, Any] | None) -> ModelView:
        if not record:
            return ModelView()
        try:
            return ModelView(
                tuple((int(i), dict(m)) for i, m in record.get("replaced", ())),
                tuple((int(i), dict(m)) for i, m in record.get("inserted", ())),
            )
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"a stored model view is malformed: {exc}") from None
