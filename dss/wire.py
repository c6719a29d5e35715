"""The typed contract between the API process, the store's RPC and vLLM's connector processes.

Everything here crosses a process boundary, so it is a small frozen dataclass of ints, strings
and tuples, defined once and imported by every side:

- `SlotRef`, `PageSlot`, `LoadPlan`, `SavePlan`: what the store tells an engine process to copy,
  and where (page bytes travel through the shared-memory host arena, never through a socket);
- `SessionTag`: what the API attaches to a session request (`SamplingParams.extra_args`);
- `TurnReport`: what the connector returns for that request (`RequestOutput.kv_transfer_params`):
  where its prompt tokens came from, per tier;
- `PageEvent`, `PageEventBatch`: what the store tells an engine about the pages it holds on host
  and disk, which the connector publishes as vLLM KV events for KV-aware routers.

Kept free of heavy imports: the engine processes import this without the database or the tiers.
vLLM carries `kv_transfer_params` as plain JSON-like dicts, so the two request-level types have a
`to_params`/`from_params` pair; nothing else builds or parses those dicts.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from dss.derive import hmac_sha256
from dss.tokens import as_tokens
from dss.types import PageHash, SessionId, TenantId, Tier

if TYPE_CHECKING:
    import numpy as np

KV_TRANSFER_PARAMS = "kv_transfer_params"

_Wire = TypeVar("_Wire")


def _pickled_by_fields(cls: type[_Wire]) -> type[_Wire]:
    """Pickle a frozen slots dataclass as its constructor and field values: a plan of 32 pages
    is 64 such objects, and the default protocol for these classes (a state getter and a setter
    that assigns each field through `object.__setattr__`) took half the time of a load plan's
    round trip on the engine's RPC (230 us of 470, issue 31). Unpickling runs `__init__`, so a
    class with a `__post_init__` check keeps it."""
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def __reduce__(self: object) -> tuple[type[_Wire], tuple[Any, ...]]:
        return cls, tuple(getattr(self, n) for n in names)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """Everything another process needs to attach a host arena."""

    path: str
    slot_nbytes: int
    n_slots: int

    @property
    def nbytes(self) -> int:
        return self.slot_nbytes * self.n_slots


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class SlotRef:
    """One slot of one host arena; names a slot to another process."""

    path: str
    slot_nbytes: int
    slot: int
    n_slots: int = 0  # of the arena, so that another process can attach it from the ref alone
    # The slot's generation when the ref was handed out. The owner bumps it whenever the slot's
    # page stops being valid (released, deleted, scrubbed), before its bytes change; a copy taken
    # through this ref is trusted only if the arena still shows this generation after the copy.
    generation: int = 0

    @property
    def arena(self) -> ArenaInfo:
        return ArenaInfo(self.path, self.slot_nbytes, self.n_slots)


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class SlotSpan:
    """Page slots of one arena, in page order (what a worker copies in one pass)."""

    arena_path: str
    slot_nbytes: int
    slots: tuple[int, ...]
    generations: tuple[int, ...]  # of each slot (`SlotRef.generation`), checked after a copy out


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class PageSlot:
    """One page of a load or save plan, with the host-arena slot that holds (or will hold) it."""

    page_index: int
    hash: PageHash
    slot: SlotRef | None
    # Where a load reads the page from: "host" when `slot` is set, else the tier it is promoted
    # from ("disk", or "remote": the fleet's shared tier).
    tier: str = "host"


def span_of(pages: tuple[PageSlot | None, ...] | tuple[PageSlot, ...]) -> SlotSpan | None:
    """The pages' slots as one span, or None when a page or slot is missing or arenas differ."""
    refs = [p.slot for p in pages if p is not None and p.slot is not None]
    if not refs or len(refs) != len(pages):
        return None
    first = refs[0]
    if any((r.path, r.slot_nbytes) != (first.path, first.slot_nbytes) for r in refs):
        return None
    return SlotSpan(
        first.path, first.slot_nbytes, tuple(r.slot for r in refs), tuple(r.generation for r in refs)
    )


def usable_prefix(pages: tuple[PageSlot | None, ...]) -> int:
    """How many pages, from the first, can be had (a page and its slot): an engine recomputes
    from the first missing one on anyway."""
    n = 0
    for ps in pages:
        if ps is None or ps.slot is None:
            break
        n += 1
    return n


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class LoadPlan:
    load_id: str
    n_tokens: int  # tokens covered by `pages`, counted from `start_token`
    start_token: int
    pages: tuple[PageSlot, ...]
    is_async: bool
    tier_tokens: dict[str, int]  # tokens of `pages` by the tier they are read from
    # How many of the tokens asked about, from the first, the store held in the tenant's own pages
    # when it planned (at least `start_token + n_tokens`; beyond the load's `max_tokens` too): a
    # save of no more tokens than these has nothing to ask for.
    stored_tokens: int = 0


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class PlannedLoad:
    """A load planned for a request before it was sent to the engine (`SessionTag.planned_load`):
    the store's answer to `begin_load(fingerprint, tenant, prompt, 0, len(prompt) - 1)`. Its
    lease is the sender's to end (`KVCache.drop_planned`) once the engine has answered the
    request's first token (its workers have copied the pages by then) or once the request is
    gone: the engine makes no store round trip for it, used or not."""

    fingerprint: str  # the engine's, as the store registered it: a plan for another is not used
    prompt: str  # `tokens_digest` of the prompt it was planned for: used for exactly that prompt
    plan: LoadPlan
    # `time.monotonic()` before it was planned (the store and its engines share a host, hence a
    # clock): a save of the session the engine saw land after this may hold pages it lacks.
    planned_at: float = 0.0


def tokens_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """A digest of token ids (32-bit), to check that a planned load meets the prompt it was planned
    for: the digest of their store form (`as_tokens`), so an int32 array (the store's token
    arrays) is digested in place and a list packed once (8 us for 1,000 ids, on the path of every
    planned turn's lookup in the engine), the same digest either way."""
    return hashlib.blake2b(as_tokens(tokens).data, digest_size=16).hexdigest()


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class SavePlan:
    save_id: str
    pages: tuple[PageSlot, ...]


PAGE_STORED = "stored"
PAGE_REMOVED = "removed"


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class PageEvent:
    """One tier change of one page (`dss.pages.events`): `kind` is `PAGE_STORED` (durable in
    `tier` from now on) or `PAGE_REMOVED` (gone from `tier`). `parent` is None for the first page
    of a sequence; `tokens` (stored events only) are the page's own token ids, `n_tokens` their
    count (fewer than the block size for a tail page); `tenant` owns the page's namespace."""

    id: int
    kind: str
    tier: str
    page: PageHash
    parent: PageHash | None
    index: int
    n_tokens: int
    tenant: str
    tokens: tuple[int, ...] = ()

    def with_id(self, id_: int) -> PageEvent:
        return replace(self, id=id_)


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class PageEventBatch:
    """An answer to `take_events`. `resync`: the reader's view is void (a new epoch, its first
    read, or events it had not read were dropped): `events` is then the table's whole holdings for
    the fingerprint, to publish after an `AllBlocksCleared`. `last_id` is the cursor for the next
    read; `dropped` counts the events this fingerprint's queue has dropped; `more`: events past
    `last_id` are already waiting."""

    epoch: str
    events: tuple[PageEvent, ...]
    last_id: int
    resync: bool
    dropped: int = 0
    more: bool = False


def tag_key(authkey: bytes) -> bytes:
    """The key that signs `SessionTag`s: derived from the store's RPC authkey, which the API and
    the connector both hold (and a client of a plain `vllm serve` does not)."""
    return hmac_sha256(authkey, "dss/session-tag-key/v2")


@dataclass(frozen=True, slots=True)
class SessionTag:
    """What the API tells the connector about one session request. The tenant is derived on the
    server from the authenticated user, never taken from a client.

    The tag travels in `kv_transfer_params`, which vLLM's own OpenAI server lets a client set: so
    it is signed (HMAC-SHA256 under `tag_key`), and the connector ignores a tag whose signature
    does not verify (the request then runs as a plain vLLM request: no load, no save), which
    keeps a client of an engine with this connector from naming someone else's tenant.

    It names no version: the connector loads the longest stored prefix of the request's token ids
    for (model, tenant), and the API has already turned a version into those ids. (Tags up to v2
    carried the version and nothing read it. A tag lives for one request between the API and its
    own engine, never stored, so no v2 tag reaches a v3 connector; one that did would fail to
    verify and run as a plain vLLM request, which is safe.)
    """

    tenant: TenantId
    session_id: SessionId

    def _mac(self, key: bytes) -> str:
        return hmac_sha256(key, "dss/session-tag/v3", self.tenant, self.session_id).hex()

    def to_params(self, key: bytes, planned: PlannedLoad | None = None) -> dict[str, Any]:
        """`planned`: the load the API process planned for the request before sending it (see
        `planned_load`), signed for this session with the same key."""
        params: dict[str, Any] = {"tenant": self.tenant, "session_id": self.session_id, "sig": self._mac(key)}
        if planned is not None:
            blob = pickle.dumps(_plan_values(planned), protocol=pickle.HIGHEST_PROTOCOL)
            params[_PLAN] = blob
            params[_PLAN_SIG] = self._plan_mac(key, blob)
        return params

    def extra_args(self, key: bytes, planned: PlannedLoad | None = None) -> dict[str, Any]:
        """`SamplingParams(extra_args=...)`: vLLM hands `kv_transfer_params` to the connector."""
        return {KV_TRANSFER_PARAMS: self.to_params(key, planned)}

    def _plan_mac(self, key: bytes, blob: bytes) -> str:
        return hmac_sha256(key, "dss/planned-load/v2", self.tenant, self.session_id, blob).hex()

    def planned_load(self, params: object, key: bytes) -> PlannedLoad | None:
        """The load planned for this request by the process that sent it, when one came with it
        and its signature verifies for this session (None otherwise).

        The API's store plans a session turn's load (matches and pins its pages) before the
        request reaches the engine, and the plan travels in the request's `kv_transfer_params`:
        the scheduler then asks the store nothing for it (issue 31: that round trip was most of
        what a hot turn cost beyond vLLM's own prefix-cache hit). A plan names host-arena slots
        the worker copies from, so only a signed one is read, and only as plain values."""
        if not isinstance(params, Mapping):
            return None
        blob, sig = params.get(_PLAN), params.get(_PLAN_SIG)
        if not isinstance(blob, bytes) or not isinstance(sig, str):
            return None
        if not hmac.compare_digest(sig, self._plan_mac(key, blob)):
            return None
        try:
            return _plan_of_values(_PlainUnpickler(io.BytesIO(blob)).load())
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError):
            return None

    @classmethod
    def from_params(cls, params: object, key: bytes) -> SessionTag | None:
        """The tag in a request's `kv_transfer_params` if its signature verifies under `key`;
        None for a plain vLLM request, and for a forged or unsigned tag (`forged` tells which)."""
        if not isinstance(params, Mapping):
            return None
        tenant, session_id = params.get("tenant"), params.get("session_id")
        if not isinstance(tenant, str) or not tenant or not isinstance(session_id, str) or not session_id:
            return None
        tag = cls(TenantId(tenant), SessionId(session_id))
        sig = params.get("sig")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, tag._mac(key)):
            return None
        return tag

    @staticmethod
    def forged(params: object, key: bytes) -> bool:
        """Whether `params` names a tenant without a valid signature (worth a log line)."""
        named = isinstance(params, Mapping) and "tenant" in params
        return named and SessionTag.from_params(params, key) is None


_PLAN, _PLAN_SIG = "load_plan", "load_plan_sig"
_PLAN_LAYOUT = 2  # of `_plan_values`; a plan of another layout is not read


def _plan_values(planned: PlannedLoad) -> tuple[Any, ...]:
    """A planned load as plain values, its pages as rows of them: pickling these is C work
    alone, where the plan's own classes cost a Python call each (66 us for a plan of 33 pages
    against 9 us, 2026-12-07), on the path of every hot turn (issue 31)."""
    plan = planned.plan
    rows = tuple(
        (p.page_index, p.hash, p.tier)
        + (() if (r := p.slot) is None else (r.path, r.slot_nbytes, r.slot, r.n_slots, r.generation))
        for p in plan.pages
    )
    return (
        _PLAN_LAYOUT, planned.fingerprint, planned.prompt, planned.planned_at,
        plan.load_id, plan.n_tokens, plan.start_token, plan.is_async, plan.tier_tokens, plan.stored_tokens,
        rows,
    )  # fmt: skip


def _plan_of_values(values: Any) -> PlannedLoad | None:
    """`_plan_values` read back; None for another layout. Malformed values raise."""
    if not isinstance(values, tuple) or not values or values[0] != _PLAN_LAYOUT:
        return None
    _, fingerprint, prompt, planned_at, load_id, n_tokens, start, is_async, tiers, stored, rows = values
    pages = tuple(_page_of_row(row) for row in rows)
    plan = LoadPlan(load_id, n_tokens, start, pages, is_async, tiers, stored)
    return PlannedLoad(fingerprint, prompt, plan, planned_at)


# The pages of plans read back, by their row: building a page and its slot (two frozen
# dataclasses) costs 2.2 us a page in an idle process, 72 us for a plan of 33 pages, on the path of
# every planned turn in the engine's scheduler, and the turns of a session load the same pages
# from the same slots again (a slot reused has a new generation, so a new row). Both are
# immutable; the map is emptied when full.
_PAGES_READ_BACK: dict[tuple[Any, ...], PageSlot] = {}
_PAGES_READ_BACK_MAX = 8192


def _page_of_row(row: tuple[Any, ...]) -> PageSlot:
    page = _PAGES_READ_BACK.get(row)
    if page is None:
        page = PageSlot(row[0], row[1], SlotRef(*row[3:]) if len(row) > 3 else None, row[2])
        if len(_PAGES_READ_BACK) >= _PAGES_READ_BACK_MAX:
            _PAGES_READ_BACK.clear()
        _PAGES_READ_BACK[row] = page
    return page


class _PlainUnpickler(pickle.Unpickler):
    """Builds no object of any class: a signed plan is plain values (`_plan_values`)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a load plan holds no {module}.{name}")


@dataclass(frozen=True, slots=True)
class TurnReport:
    """What the connector did for one finished session request.

    `engine_cached_tokens` came from vLLM's own prefix cache; `loaded_from` from each DSS tier
    (tokens that failed to load and were recomputed are not in it); `found_in` is what the store
    held beyond the engine's cache when the connector asked, by tier; `store_errors` counts store
    calls for this request that failed or missed their deadline (each one was a cache miss);
    `planned_ahead`: the load was the one planned before the request was sent (`PlannedLoad`),
    so the engine asked the store nothing for it.
    """

    session_id: SessionId
    fingerprint: str | None
    engine_cached_tokens: int = 0
    loaded_from: dict[str, int] = field(default_factory=dict)
    found_in: dict[str, int] = field(default_factory=dict)
    failed_tokens: int = 0
    stored_pages: int = 0
    computed_tokens: int = 0
    store_errors: int = 0
    # Why the connector stopped storing and loading in this engine ("" while it works): the API
    # process shows it in /readyz and `dss_kv_caching_enabled` instead of a log line in the engine.
    caching_off: str = ""
    planned_ahead: bool = False

    @property
    def loaded_tokens(self) -> int:
        return sum(self.loaded_from.values())

    def to_params(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "fingerprint": self.fingerprint,
            "engine_cached_tokens": self.engine_cached_tokens,
            "loaded_from": dict(self.loaded_from),
            "loaded_tokens": self.loaded_tokens,
            "found_in": dict(self.found_in),
            "failed_tokens": self.failed_tokens,
            "stored_pages": self.stored_pages,
            "computed_tokens": self.computed_tokens,
            "store_errors": self.store_errors,
            "caching_off": self.caching_off,
            "planned_ahead": self.planned_ahead,
        }

    @classmethod
    def from_params(cls, params: object) -> TurnReport | None:
        if not isinstance(params, Mapping) or not isinstance(params.get("session_id"), str):
            return None
        fingerprint = params.get("fingerprint")
        return cls(
            session_id=SessionId(str(params["session_id"])),
            fingerprint=fingerprint if isinstance(fingerprint, str) else None,
            engine_cached_tokens=_count(params.get("engine_cached_tokens")),
            loaded_from=_tier_counts(params.get("loaded_from")),
            found_in=_tier_counts(params.get("found_in")),
            failed_tokens=_count(params.get("failed_tokens")),
            stored_pages=_count(params.get("stored_pages")),
            computed_tokens=_count(params.get("computed_tokens")),
            store_errors=_count(params.get("store_errors")),
            caching_off=str(params.get("caching_off") or "")[:500],
            planned_ahead=params.get("planned_ahead") is True,
        )


def _tier_counts(raw: object) -> dict[str, int]:
    if not isinstance(raw, Mapping):
        return {}
    tiers = {t.value for t in Tier}
    return {str(k): n for k, v in raw.items() if k in tiers and (n := _count(v))}


def _count(v: object) -> int:
    return v if isinstance(v, int) and v > 0 else 0
