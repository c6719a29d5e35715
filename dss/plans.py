"""Load and save plans: what the store tells an engine process to copy, and where.

Kept free of heavy imports: engine processes import this (through `dss.rpc`) without the
database or the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dss.tiers.host import SlotRef
from dss.types import PageHash


@dataclass(frozen=True, slots=True)
class PageSlot:
    """One page of a load or save plan, with the host-arena slot that holds (or will hold) it."""

    page_index: int
    hash: PageHash
    slot: SlotRef | None


@dataclass(frozen=True, slots=True)
class LoadPlan:
    load_id: str
    n_tokens: int  # tokens covered by `pages`, counted from `start_token`
    start_token: int
    pages: tuple[PageSlot, ...]
    is_async: bool
    tier_tokens: dict[str, int]


@dataclass(frozen=True, slots=True)
class SavePlan:
    save_id: str
    pages: tuple[PageSlot, ...]
