"""Where to cut a dialogue that outgrew the model's context (`truncation: "auto"`, as OpenAI's
Responses API defines it: items are dropped from the beginning of the conversation).

DSS cuts in large steps: when the dialogue does not fit, it keeps the lead (the system prompt)
and the newest messages from a user message on, as few as make the kept part at most
`KEEP_FRACTION` of the room. The turns after a cut extend the shortened dialogue, so its prefix
stays the same, and is served from cache, until it outgrows the context again (about half a
context of turns later); cutting one message at a time instead would change the prefix on every
turn and recompute all of it each time. What the model saw is recorded with the version
(`dss.dialogue.lead.view.ModelView.dropped`); the version keeps every message.

Pure functions over per-message sizes (token counts the caller estimates).
"""

from __future__ import annotations

from collections.abc import Sequence

KEEP_FRACTION = 0.5


def cut_points(roles: Sequence[str], sizes: Sequence[int], has_lead: bool, room: int) -> list[int]:
    """The indices a shortened dialogue may start from after its lead, best first: user messages
    whose kept part (with the lead) fits `KEEP_FRACTION` of `room`, then later ones (for the
    caller to try when its estimate was short). Never past the last user message; empty when no
    cut is possible (no user message after the lead but the first)."""
    first = 1 if has_lead else 0
    lead = sizes[0] if has_lead else 0
    users = [i for i in range(first + 1, len(roles)) if roles[i] == "user"]
    if not users:
        return []
    target = KEEP_FRACTION * room
    suffix = [0] * (len(sizes) + 1)
    for i in range(len(sizes) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + sizes[i]
    fitting = [i for i in users if lead + suffix[i] <= target]
    start = fitting[0] if fitting else users[-1]
    return [i for i in users if i >= start]
