"""What a soak client keeps of what the server acknowledged: its sessions as it knows them
(`Sess`), the ledger's entries (`Entry`: a version that must stay readable unless its user is
erased after it was sent), its stored responses (`Resp`), and the traffic's vocabulary.

The ledger holds only versions the server acknowledged; an entry leaves it when the client deletes
or erases what it names, or when an erasure of its user may have taken it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_SESSIONS = 3  # per client
MAX_DEPTH = 13  # messages in a version before a client stops extending it
MAX_BRANCHES = 6  # per session

QUESTIONS = [
    "Which shelf holds the oldest item?",
    "Name one item from the list.",
    "What is on shelf 3?",
    "Summarise the room in five words.",
    "Which year appears most often?",
    "Is there anything made of brass?",
    "What should a visitor see first?",
    "Answer with one word: big or small?",
    "Count the shelves you know about.",
    "Which item would you lend out?",
    "Repeat the session code.",
    "What did I ask before?",
]
ITEMS = [
    "a brass compass", "an oak chest", "a glass lantern", "a silver spoon", "a wool blanket",
    "a copper kettle", "a paper map", "a tin soldier", "a clay pot", "a leather boot",
    "an iron key", "a linen shirt", "a bone comb", "a stone axe", "a cork float",
]  # fmt: skip


Messages = list[dict[str, Any]]


@dataclass
class Sess:
    sid: str
    marker: str
    system: str
    stored_system: bool  # created by POST /v1/sessions with the system prompt
    branches: dict[str, int] = field(default_factory=lambda: {"main": 0})
    known: dict[int, Messages] = field(default_factory=dict)  # acknowledged or read back
    parents: dict[int, int | None] = field(default_factory=dict)
    vcount: int = 0
    dirty: bool = False  # its state is uncertain: re-read it before the next step
    n_branches: int = 0

    def root(self) -> Messages:
        return [{"role": "system", "content": self.system}]

    def base(self, head: int) -> Messages:
        return self.root() if head == 0 else self.known[head]


@dataclass
class Entry:
    """An acknowledged version. `messages` is what the version must list; a Responses version
    (`response_id`) is checked by its last message (`text`) and by `GET /v1/responses/{id}`."""

    sid: str
    number: int
    parent: int | None
    branch: str
    messages: Messages | None
    via: str
    q: float = 0.0  # when its request was sent
    a: float = 0.0  # when its acknowledgement arrived
    text: str | None = None
    response_id: str | None = None


@dataclass
class Resp:
    """A stored response of this client (a version of its `resp-…` session)."""

    id: str
    sid: str
    version: int
    q: float
    children: int = 0


def same_content(listed: Messages, e: Entry) -> bool:
    """A version's messages as read back against the ledger: all of them, or (a response) the
    answer, its last message."""
    if e.messages is not None:
        return listed == e.messages
    return bool(listed) and listed[-1].get("content") == e.text


@dataclass
class Held:
    """Something an end user of the soak's frontend holds (`kind`: a session, a conversation, an
    item of one, a response in one), acknowledged by the server. `q` and `end` are when the last
    write naming it was sent and when it ended: an erasure of the end user sent after `end` must
    leave nothing of it visible; one sent between `q` and `end` raced that write."""

    kind: str  # "session", "conversation", "item", "response"
    id: str
    conv: str | None  # the conversation of an item or a response
    q: float
    end: float
    messages: Messages = field(default_factory=list)  # a session's dialogue, to continue it
    acked: bool = True  # False: a new session whose first turn got no answer (it may exist)


@dataclass
class EndUser:
    """One end user of the soak's frontend key: the DSS user `<frontend>/<name>` (`label`, the
    `ErasureLog`'s key), what it holds (by (kind, id)), its erasures taken into account."""

    name: str
    label: str
    held: dict[tuple[str, str], Held] = field(default_factory=dict)
    processed: int = 0  # its erasures (ErasureLog.of) taken into account
    last_write_q: float = 0.0  # when its last write was sent, answered or not
    markers: list[tuple[str, float]] = field(default_factory=list)  # its texts' markers, write ended
    erased_markers: list[str] = field(default_factory=list)  # of writes ended before an erasure

    def of_kind(self, kind: str) -> list[Held]:
        return sorted((h for h in self.held.values() if h.kind == kind), key=lambda h: h.id)
