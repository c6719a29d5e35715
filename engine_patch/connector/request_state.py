"""What the scheduler side holds for one session request (`RequestState`), from its first lookup
to its finish, where it becomes the request's `TurnReport`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from dss.wire import LoadPlan, PlannedLoad, SessionTag, TurnReport

if TYPE_CHECKING:
    from vllm.v1.request import Request

BlockIds = tuple[list[int], ...]  # a request's engine block ids, one list per KV cache group


def session_key(tag: SessionTag) -> tuple[str, str]:
    return (tag.tenant, tag.session_id)


@dataclass(slots=True)
class Claim:
    """A lookup answered for a waiting request: its pages are pinned in the store. `skip_pages`:
    pages at the front of the store's lease that the load leaves out (a plan made before the
    engine's own prefix-cache hit was known, `SchedulerSide._take_planned`)."""

    plan: LoadPlan
    start_token: int
    skip_pages: int = 0
    # Planned by the request's sender, who ends the lease once the request is answered or gone
    # (`SessionTag.planned_load`): neither side of the connector releases it.
    planned: bool = False


@dataclass(slots=True)
class RequestState:
    """Everything the scheduler side holds for one session request, from its first lookup to its
    finish, where it becomes the request's `TurnReport`. Requests without a (verified) session
    have none: they are plain vLLM."""

    request: Request
    session: SessionTag
    saves_prompt: bool = False  # its whole prompt pages are saved when its prefill completes
    windowed: bool = False  # its pages are saved before they leave a sliding window
    claim: Claim | None = None  # a lookup's pinned pages, until vLLM allocates the blocks
    planned: PlannedLoad | None = None  # the load planned before the request came (until taken)
    planned_ahead: bool = False  # that plan was taken: no lookup of the store
    deferred_since: float | None = None  # first "ask again" while the session's last save settles
    loading_async: bool = False  # pages still arriving on the worker's loader thread
    hit_sources: dict[CacheHitSource, int] = field(default_factory=dict)  # for vLLM's hit metrics
    # What the connector did so far (the report):
    engine_cached: int = 0  # vLLM's own prefix-cache hit when the store was asked
    page_tiers: list[str] = field(default_factory=list)  # tier of each page handed to the worker
    loaded_tokens: int = 0  # tokens those pages hold (the last one may be a tail page)
    found_in: dict[str, int] = field(default_factory=dict)  # what the store had, by tier
    failed_tokens: int = 0
    stored_pages: int = 0
    # tokens, from the first, the store is known to hold: a save plan's, or what the load found
    planned_tokens: int = 0
    store_errors: int = 0

    @property
    def req_id(self) -> str:
        return str(self.request.request_id)

    def report(self, block_size: int, fingerprint: str | None, caching_off: str) -> TurnReport:
        """What the connector did for the request. Failed pages are the last ones (vLLM
        recomputes from there); a tail page counts its valid tokens."""
        bs = block_size
        n_ok = max(0, len(self.page_tiers) - (self.failed_tokens + bs - 1) // bs) if bs else 0
        loaded = tokens_by_tier(self.page_tiers[:n_ok], min(self.loaded_tokens, n_ok * bs), bs)
        return TurnReport(
            session_id=self.session.session_id,
            fingerprint=fingerprint,
            engine_cached_tokens=self.engine_cached,
            loaded_from=loaded,
            found_in=self.found_in,
            failed_tokens=self.failed_tokens,
            stored_pages=self.stored_pages,
            computed_tokens=int(self.request.num_computed_tokens),
            store_errors=self.store_errors,
            caching_off=caching_off,
            planned_ahead=self.planned_ahead,
        )


def tokens_by_tier(tiers: list[str], n_tokens: int, block_size: int) -> dict[str, int]:
    """`n_tokens` spread over pages of `block_size` read from `tiers` (the last may be partial)."""
    if block_size <= 0 or n_tokens <= 0:
        return {}
    whole = min(len(tiers), n_tokens // block_size)
    out = {tier: pages * block_size for tier, pages in Counter(tiers[:whole]).items()}
    rest = n_tokens - whole * block_size
    if rest > 0 and whole < len(tiers):
        out[tiers[whole]] = out.get(tiers[whole], 0) + min(rest, block_size)
    return out
