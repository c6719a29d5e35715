"""A load plan says how far the store holds the sequence asked about, past what may be loaded:
the engine then does not ask to save what the store has (a one-token answer to a prompt seen
before computes nothing the store lacks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.store import Store
from dss.types import PUBLIC_TENANT
from tests.store_helpers import SMALL_FP, open_store, page_bytes, pages_for, put_sequence

BS = SMALL_FP.block_size


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path)
    s.fingerprints.register(SMALL_FP)
    try:
        yield s
    finally:
        s.close()


def stored_tokens(store: Store, tenant: str, tokens: np.ndarray, max_tokens: int) -> int:
    plan = store.kv.begin_load(SMALL_FP.id, tenant, tokens, 0, max_tokens)
    assert plan is not None
    store.kv.loads.release(plan.load_id)
    return plan.stored_tokens


def test_a_load_plan_counts_what_the_store_holds_past_the_load(store: Store) -> None:
    alice = store.identity.tenant_for("alice")
    prompt = np.arange(1, 4 * BS + 3, dtype=np.int32)  # four whole pages and a tail of 2
    put_sequence(store, SMALL_FP.id, alice, prompt, [*pages_for(SMALL_FP, prompt), page_bytes(SMALL_FP, 9)])
    n = len(prompt)
    # The engine may load all but the last token; the store holds the whole prompt.
    assert stored_tokens(store, alice, prompt, n - 1) == n
    # A longer sequence (the prompt and a new token): held as far as the prompt.
    assert stored_tokens(store, alice, np.append(prompt, 77), n) == n
    # A load that stops short of `max_tokens` (the store holds less): what it loads, nothing more.
    longer = np.concatenate([prompt[: 2 * BS], np.arange(500, 500 + 2 * BS + 2, dtype=np.int32)])
    assert stored_tokens(store, alice, longer, n - 1) == 2 * BS


def test_public_pages_count_only_as_far_as_they_are_loaded(store: Store) -> None:
    """A match that starts with public pages is not credited past the load: saving the sequence
    links those pages into the tenant's own trie, so the engine must still ask."""
    fid = SMALL_FP.id
    system = np.arange(500, 500 + 2 * BS, dtype=np.int32)
    store.prefixes.register(fid, system, text="system prompt", pin=True)
    put_sequence(store, fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
    bob = store.identity.tenant_for("bob")
    prompt = np.concatenate([system, np.arange(1, 1 + 2 * BS, dtype=np.int32)])
    put_sequence(store, fid, bob, prompt, pages_for(SMALL_FP, prompt))
    assert stored_tokens(store, bob, prompt, 3 * BS) == 3 * BS


def test_a_few_tokens_at_the_start_of_a_new_sequence_are_not_loaded(store: Store) -> None:
    """Another chat's tail page matching only the chat template's opening: loading those few
    tokens cost a cold prompt more than computing them (bench/cold_concurrent.py: DSS's time to
    first token 1.3x the same engine's without the connector; docs/operations.md)."""
    alice = store.identity.tenant_for("alice")
    short = np.arange(1, BS, dtype=np.int32)  # a short chat: one tail page
    put_sequence(store, SMALL_FP.id, alice, short, [page_bytes(SMALL_FP, 3)])
    opening = short[:2]
    cold = np.concatenate([opening, np.arange(900, 900 + 3 * BS, dtype=np.int32)])
    assert store.kv.begin_load(SMALL_FP.id, alice, cold, 0, len(cold) - 1) is None
    # The same short history as most of a sequence (its next turn) still loads, whole.
    follow = np.concatenate([short, np.arange(900, 902, dtype=np.int32)])
    plan = store.kv.begin_load(SMALL_FP.id, alice, follow, 0, len(follow) - 1)
    assert plan is not None and plan.n_tokens == len(short)
    store.kv.loads.release(plan.load_id)
