"""The scheduler half of the connector against a real store over its RPC, with real vLLM `Request`
objects (no engine): claims, caps, plan caching and release, saves and the same-session settle."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from dss.rpc import StoreClient
from dss.store import Store
from dss.types import TenantId
from dss.wire import PlannedLoad, SessionTag, SlotRef, TurnReport, tag_key, tokens_digest
from engine_patch.connector.metadata import DSSConnectorMetadata, DSSWorkerMetadata, SaveSpec
from engine_patch.connector.scheduler_side import SchedulerSide
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

BS = SMALL_FP.block_size
# The key the API signs session tags with; in the server it derives from the store's authkey.
TAG_KEY = tag_key(b"scheduler-side tests")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "store")
    s.fingerprints.register(SMALL_FP)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def side(store: Store) -> Iterator[SchedulerSide]:
    address, authkey = store.serve_rpc()
    blocks: dict[str, tuple[list[int], ...]] = {}
    sched = SchedulerSide(
        SMALL_FP,
        StoreClient(address, authkey),
        settle_timeout_s=5.0,
        block_ids_of=blocks.__getitem__,
        tag_key=TAG_KEY,
    )
    sched.test_blocks = blocks  # type: ignore[attr-defined]
    try:
        yield sched
    finally:
        sched.shutdown()


def request(
    req_id: str,
    tokens: list[int],
    tenant: str | None,
    session_id: str = "s1",
    key: bytes = TAG_KEY,
    planned: PlannedLoad | None = None,
) -> Request:
    extra = SessionTag(TenantId(tenant), session_id).extra_args(key, planned) if tenant else None
    return Request(req_id, tokens, SamplingParams(max_tokens=4, extra_args=extra), None)


def planned_request(store: Store, req_id: str, tokens: list[int], tenant: str, **kw: Any) -> Request:
    """A request whose load the API's store planned before sending it (`KVCache.plan_ahead`)."""
    planned = store.kv.plan_ahead(SMALL_FP.id, TenantId(tenant), tokens)
    assert planned is not None
    return request(req_id, tokens, tenant, planned=planned, **kw)


def end_planned_lease(store: Store, r: Request) -> None:
    """What the request's sender does once its first token is back or it is gone: end the lease
    of the load it planned (`KVCache.drop_planned`)."""
    params = r.kv_transfer_params
    tag = SessionTag.from_params(params, TAG_KEY)
    planned = tag.planned_load(params, TAG_KEY) if tag is not None else None
    assert planned is not None
    store.kv.drop_planned(planned)


def finished_turn_then_planned_next(store: Store, side: SchedulerSide) -> tuple[Request, SaveSpec, Request]:
    """A turn (2 stored pages, then one more and a tail computed) whose finish-time save is handed
    to the worker, and the session's next turn, planned at once (before that save landed)."""
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 2 * BS)
    r = request("r1", [*tokens, *range(500, 500 + BS + 1)], tenant)
    r.num_computed_tokens = 3 * BS + 1
    assert side.request_finished(r, ([10, 11, 12, 13],))[0]
    (save,) = step(side).saves
    return r, save, planned_request(store, "r2", [*r.all_token_ids, 7], tenant)


def write_slots(store: Store, save: SaveSpec, written: list[bytes]) -> None:
    """The worker's copy into a save's reserved slots, as the store sees it."""
    assert save.span is not None
    for idx, slot in zip(save.page_indexes, save.span.slots, strict=True):
        ref = SlotRef(save.span.arena_path, save.span.slot_nbytes, slot)
        store.pages.host.slot_array(ref)[:] = np.frombuffer(written[idx], dtype=np.uint8)


def no_lookups(side: SchedulerSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the scheduler may not ask the store for a load plan."""

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the scheduler asked the store for a load it was given")

    monkeypatch.setattr(side.client, "begin_load", refused)


def step(side: SchedulerSide, scheduled: dict[str, int] | None = None) -> DSSConnectorMetadata:
    """`build_connector_meta` for a step that schedules `scheduled` tokens per request."""
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = dict(scheduled or {})
    return side.build_connector_meta(out)


def blocks_of(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def stored(store: Store, tenant: str, n_tokens: int, seed: int = 0) -> list[int]:
    tokens = np.arange(seed, seed + n_tokens, dtype=np.int32)
    put_sequence(store, SMALL_FP.id, tenant, tokens, pages_for(SMALL_FP, tokens))
    return [int(t) for t in tokens]


def recorded_plan_saves(side: SchedulerSide, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The arguments of every `plan_save` the scheduler asks the store from now on."""
    assert side.client is not None
    calls: list[tuple[Any, ...]] = []
    plan_save = side.client.plan_save

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return plan_save(*args, **kwargs)

    monkeypatch.setattr(side.client, "plan_save", recorded)
    return calls


def test_request_without_session_is_left_alone(store: Store, side: SchedulerSide) -> None:
    tokens = stored(store, store.identity.tenant_for("u"), 5 * BS)
    assert side.get_num_new_matched_tokens(request("r", tokens, None), 0) == (0, False)
    assert side.request_finished(request("r", tokens, None), ([0, 1, 2, 3, 4],)) == (False, None)
    assert store.stats()["leases"] == 0


def test_claims_are_capped_cached_and_released(store: Store, side: SchedulerSide) -> None:
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 5 * BS)
    # A block-aligned prompt: a sync hit must leave the last token, so the last page serves all
    # but its last token.
    r = request("r1", tokens, tenant)
    assert side.get_num_new_matched_tokens(r, 0) == (5 * BS - 1, False)
    assert side.get_num_new_matched_tokens(r, 0) == (5 * BS - 1, False)  # cached: no second lease
    assert store.stats()["leases"] == 1
    # vLLM's own cache now covers a page: the old plan is released, a new one starts after it.
    assert side.get_num_new_matched_tokens(r, BS) == (4 * BS - 1, False)
    assert store.stats()["leases"] == 1
    side.update_state_after_alloc(r, blocks_of([9, 8, 7, 6, 5]), 4 * BS - 1)
    meta = step(side)
    (load,) = meta.loads
    assert load.block_ids == ((8, 7, 6, 5),) and not load.is_async
    assert load.span is not None and len(load.span.slots) == 4
    assert step(side).loads == []
    # A claim that vLLM never allocated is released when the request goes away.
    r2 = request("r2", [*tokens, 1, 2], tenant)
    assert side.get_num_new_matched_tokens(r2, 0) == (5 * BS, False)
    assert store.stats()["leases"] == 2
    side.request_finished(r2, ([],))
    assert store.stats()["leases"] == 1  # r1's lease stays until its worker releases it


def test_unsigned_or_forged_session_tags_are_ignored(store: Store, side: SchedulerSide) -> None:
    # A client of an engine running this connector sets `kv_transfer_params` itself, naming
    # alice's tenant: without the store's key it neither reads nor writes alice's pages.
    tenant = store.identity.tenant_for("alice")
    tokens = stored(store, tenant, 4 * BS)
    unsigned = Request(
        "r1",
        [*tokens, 1],
        SamplingParams(
            max_tokens=4, extra_args={"kv_transfer_params": {"tenant": tenant, "session_id": "s"}}
        ),
        None,
    )
    forged = request("r2", [*tokens, 1], tenant, key=tag_key(b"a guess"))
    for r in (unsigned, forged):
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)
        assert side.request_finished(r, (list(range(5)),)) == (False, None)
    assert store.stats()["leases"] == 0
    assert side.get_num_new_matched_tokens(request("r3", [*tokens, 1], tenant), 0) == (4 * BS, False)


def test_a_planned_load_is_taken_without_asking_the_store(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = store.identity.tenant_for("u")
    tokens = [*stored(store, tenant, 4 * BS), 1]
    r = planned_request(store, "r1", tokens, tenant)
    assert store.stats()["leases"] == 1  # pinned when planned, before the engine had the request
    no_lookups(side, monkeypatch)
    assert side.get_num_new_matched_tokens(r, 0) == (4 * BS, False)
    side.update_state_after_alloc(r, blocks_of([9, 8, 7, 6, 5]), 4 * BS)
    (load,) = step(side).loads
    assert load.block_ids == ((9, 8, 7, 6),) and load.skip_pages == 0 and load.span is not None
    # vLLM's own cache holds the first two pages: the load leaves them out of the same lease.
    r2 = planned_request(store, "r2", tokens, tenant)
    assert side.get_num_new_matched_tokens(r2, 2 * BS) == (2 * BS, False)
    side.update_state_after_alloc(r2, blocks_of([1, 2, 3, 4, 5]), 2 * BS)
    (load,) = step(side).loads
    assert load.block_ids == ((3, 4),) and load.skip_pages == 2 and len(load.span.slots) == 2
    r2.num_computed_tokens = len(tokens)
    report = TurnReport.from_params(side.request_finished(r2, ([1, 2, 3, 4, 5],))[1])
    assert report is not None and report.engine_cached_tokens == 2 * BS and report.loaded_tokens == 2 * BS
    assert report.found_in == {"host": 2 * BS}
    assert load.release_lease is False  # planned: the sender ends the lease, not the workers
    assert store.stats()["leases"] == 2
    for planned in (r, r2):
        end_planned_lease(store, planned)
    assert store.stats()["leases"] == 0


def test_a_planned_load_that_cannot_be_used_is_left_to_its_sender(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine makes no store round trip for a planned load it does not use: its lease is the
    sender's to end; one the scheduler looked up itself instead is the engine's."""
    tenant = store.identity.tenant_for("u")
    tokens = [*stored(store, tenant, 4 * BS), 1]
    no_lookups(side, monkeypatch)
    # vLLM's own cache holds all of it: nothing to load.
    r1 = planned_request(store, "r1", tokens, tenant)
    assert side.get_num_new_matched_tokens(r1, 4 * BS) == (0, False)
    side.request_finished(r1, ([],))
    # Aborted before the scheduler ever asked.
    r2 = planned_request(store, "r2", tokens, tenant)
    side.request_finished(r2, ([],))
    assert store.stats()["leases"] == 2
    for r in (r1, r2):
        end_planned_lease(store, r)
    assert store.stats()["leases"] == 0
    # A plan made for another engine's model, or for another prompt, is not trusted with this
    # request's blocks: the store is asked, and the engine releases what it asked for.
    monkeypatch.undo()
    another_model: dict[str, Any] = {"fingerprint": "another-model"}
    another_prompt: dict[str, Any] = {"prompt": tokens_digest([7, 7])}
    for i, wrong in enumerate((another_model, another_prompt)):
        made = store.kv.plan_ahead(SMALL_FP.id, TenantId(tenant), tokens)
        assert made is not None
        r = request(f"r3-{i}", tokens, tenant, planned=replace(made, **wrong))
        assert side.get_num_new_matched_tokens(r, 0) == (4 * BS, False)  # looked up instead
        assert store.stats()["leases"] == 2
        side.request_finished(r, ([],))
        assert store.stats()["leases"] == 1  # the sender's
        store.kv.drop_planned(made)
        assert store.stats()["leases"] == 0


def test_a_planned_load_is_only_read_under_the_sessions_signature(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan names arena slots: one not signed for this very session (forged, or copied from
    another request's parameters) is never used, whatever it names."""
    alice, mallory = store.identity.tenant_for("alice"), store.identity.tenant_for("mallory")
    tokens = [*stored(store, alice, 4 * BS), 1]
    alices = store.kv.plan_ahead(SMALL_FP.id, TenantId(alice), tokens)
    assert alices is not None
    copied = SessionTag(TenantId(alice), "s1").to_params(TAG_KEY, alices)
    theirs = SessionTag(TenantId(mallory), "s1").to_params(TAG_KEY)
    theirs.update(load_plan=copied["load_plan"], load_plan_sig=copied["load_plan_sig"])
    forged = SessionTag(TenantId(mallory), "s1").to_params(tag_key(b"a guess"), alices)
    forged.update(sig=theirs["sig"])
    for i, params in enumerate((theirs, forged)):
        sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
        r = Request(f"m{i}", tokens, sampling, None)
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # mallory's own lookup: nothing
        side.request_finished(r, ([],))
    assert store.stats()["leases"] == 1  # alice's plan, never used: it waits for its timeout
    store.kv.drop_planned(alices)
    assert store.stats()["leases"] == 0


def test_a_planned_load_waits_for_the_sessions_save_in_flight(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned before the previous turn's save landed, the plan may lack its pages: it is
    released and the store asked again once the save settled."""
    _, save, nxt = finished_turn_then_planned_next(store, side)
    assert side.get_num_new_matched_tokens(nxt, 0) == (None, False)
    assert store.stats()["leases"] == 1  # the plan's, until its sender ends it
    end_planned_lease(store, nxt)
    store.kv.saves.abort_save(save.save_id)
    side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert side.get_num_new_matched_tokens(nxt, 0) == (2 * BS, False)


def test_a_load_planned_before_the_sessions_last_save_landed_is_not_taken(
    store: Store, side: SchedulerSide
) -> None:
    """CI, s43: the API planned a turn the moment the previous turn's answer came back, before
    the engine's worker had committed that turn's finish-time save; by the time the scheduler
    saw the new request the save had landed (nothing in flight any more) and the plan, lacking
    its pages, was taken: the turn loaded less than the store held. A save the engine saw land
    after the plan was made now sends the scheduler to the store."""
    r, save, nxt = finished_turn_then_planned_next(store, side)  # planned: 2 pages
    # The worker copies the save's pages and the store commits them; the engine learns it.
    whole = pages_for(SMALL_FP, np.asarray(r.all_token_ids[: 3 * BS], dtype=np.int32))
    written = [*whole, bytes(SMALL_FP.page_nbytes)]  # and the tail page
    write_slots(store, save, written)
    assert store.kv.saves.commit_save(save.save_id, save.page_indexes) == len(save.page_indexes)
    side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    n, _ = side.get_num_new_matched_tokens(nxt, 0)
    assert n is not None and n > 2 * BS  # the saved pages too, not the plan's 2 pages
    side.request_finished(nxt, ([],))
    assert store.stats()["leases"] == 1  # the plan's, until its sender ends it
    end_planned_lease(store, nxt)
    assert store.stats()["leases"] == 0


def test_other_tenants_match_nothing(store: Store, side: SchedulerSide) -> None:
    tokens = stored(store, store.identity.tenant_for("alice"), 4 * BS)
    bob = request("r", [*tokens, 1], store.identity.tenant_for("bob"))
    assert side.get_num_new_matched_tokens(bob, 0) == (0, False)


def test_finish_saves_only_new_pages_and_settles_the_next_turn(store: Store, side: SchedulerSide) -> None:
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 2 * BS)
    r = request("r1", [*tokens, *range(500, 500 + 2 * BS + 1)], tenant)
    r.num_computed_tokens = 4 * BS + 1
    done, params = side.request_finished(r, ([10, 11, 12, 13, 14],))
    assert done and params is not None
    assert (
        params["stored_pages"] == 3 and params["session_id"] == "s1" and params["fingerprint"] == SMALL_FP.id
    )
    (save,) = step(side).saves
    # Pages 2 and 3 are whole; page 4 holds one computed token: it is saved as the tail page.
    assert save.page_indexes == (2, 3, 4) and save.block_ids == ((12, 13, 14),) and save.on_finish
    assert save.tail_tokens == 1  # the worker clears the rest of that block before it commits
    # The session's next turn waits until the worker reports the save done...
    nxt = request("r2", [*r.all_token_ids, 7, 7], tenant)
    assert side.get_num_new_matched_tokens(nxt, 0) == (None, False)
    store.kv.saves.abort_save(save.save_id)
    side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    # ...then matches what the store has (the aborted pages are simply not there).
    assert side.get_num_new_matched_tokens(nxt, 0) == (2 * BS, False)
    # A worker that reports failed pages lowers the loaded count in the response.
    side.update_state_after_alloc(nxt, blocks_of([1, 2, 3, 4, 5]), 2 * BS)
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=DSSWorkerMetadata({"r2": BS})))
    nxt.num_computed_tokens = 0
    _, params = side.request_finished(nxt, ([],))
    assert params is not None and params["loaded_tokens"] == BS


def test_prompt_pages_are_saved_when_prefill_completes(store: Store, side: SchedulerSide) -> None:
    tenant = store.identity.tenant_for("u")
    r = request("r1", list(range(100, 100 + 3 * BS + 2)), tenant)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    side.test_blocks["r1"] = ([4, 5, 6, 7],)  # type: ignore[attr-defined]
    # A first prefill chunk does not finish the prompt: nothing to save yet.
    assert step(side, {"r1": 2 * BS}).saves == []
    r.num_computed_tokens = 2 * BS
    (save,) = step(side, {"r1": BS + 2}).saves
    assert save.page_indexes == (0, 1, 2) and save.block_ids == ((4, 5, 6),) and not save.on_finish
    assert save.tail_tokens == 0  # after prefill: whole pages only
    assert step(side, {"r1": 1}).saves == []
    store.kv.saves.abort_save(save.save_id)


def test_a_prefill_whose_pages_the_load_brought_asks_the_store_nothing(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same prompt again (a regenerated answer, a hot turn): the load pinned every whole
    page of the prompt in the store, so the save after its prefill has nothing to ask about; a
    prompt with a new whole page still asks, for that page."""
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 3 * BS)
    calls = recorded_plan_saves(side, monkeypatch)
    for req_id, prompt, new_pages in (
        ("r1", [*tokens, 1, 2], ()),
        ("r2", [*tokens, *range(7, 7 + BS)], (3,)),
    ):
        r = request(req_id, prompt, tenant)
        assert side.get_num_new_matched_tokens(r, 0) == (3 * BS, False)
        side.update_state_after_alloc(r, blocks_of([4, 5, 6, 7]), 3 * BS)
        side.test_blocks[req_id] = ([4, 5, 6, 7],)  # type: ignore[attr-defined]
        r.num_computed_tokens = 3 * BS  # loaded; the step computes the rest of the prompt
        meta = step(side, {req_id: len(prompt) - 3 * BS})
        assert [s.page_indexes for s in meta.saves] == ([new_pages] if new_pages else [])
        for save in meta.saves:
            store.kv.saves.abort_save(save.save_id)
    assert [args[3] for args in calls] == [4]  # r2's four whole pages; nothing for r1


def test_a_one_token_answer_to_a_stored_prompt_asks_nothing_at_finish(
    store: Store, side: SchedulerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt the store holds whole, its tail page too (a hot turn, a regenerated one-token
    answer): the request computes nothing the store lacks, so its finish asks no `plan_save`;
    an answer that decoded a token past the prompt still asks, and saves that token's page; and
    so does one whose load failed a check (the store may have lost what it said it held)."""
    tenant = store.identity.tenant_for("u")
    prompt = stored(store, tenant, 3 * BS)
    calls = recorded_plan_saves(side, monkeypatch)
    for req_id, computed, failed in (("r1", 3 * BS, 0), ("r2", 3 * BS + 1, 0), ("r3", 3 * BS, BS)):
        r = request(req_id, prompt, tenant)
        assert side.get_num_new_matched_tokens(r, 0) == (3 * BS - 1, False)
        side.update_state_after_alloc(r, blocks_of([4, 5, 6]), 3 * BS - 1)
        (load,) = step(side).loads
        store.kv.loads.release(load.load_id)  # copied, as a worker would
        if failed:
            worker = DSSWorkerMetadata({req_id: failed})
            side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker))
        r.append_output_token_ids([9, 9][: computed - 3 * BS + 1])
        r.num_computed_tokens = computed
        done, _ = side.request_finished(r, ([4, 5, 6, 7],))
        saves = step(side).saves
        assert done == bool(saves)
        for save in saves:
            assert save.page_indexes == (3,) and save.tail_tokens == 1
            store.kv.saves.abort_save(save.save_id)
            side.update_connector_output(KVConnectorOutput(finished_sending={req_id}))
    assert [len(args[2]) for args in calls] == [3 * BS + 1, 3 * BS]  # r2's and r3's; nothing for r1


def test_a_hung_owner_is_a_miss_within_the_deadline(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store stops answering (say, it deadlocked): vLLM's scheduler must not hang in
    `get_num_new_matched_tokens`; the request recomputes and its report counts the failure."""
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 3 * BS)
    answer = threading.Event()
    real = store.kv.begin_load

    def hung(*args: object, **kwargs: object) -> object:
        answer.wait(10)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.kv, "begin_load", hung)
    address, authkey = store.serve_rpc()
    client = StoreClient(address, authkey, timeout_s=0.5)
    sched = SchedulerSide(SMALL_FP, client, block_ids_of={}.__getitem__, tag_key=TAG_KEY)
    try:
        r = request("r1", [*tokens, 1], tenant)
        t0 = time.monotonic()
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert time.monotonic() - t0 < 1.5
        answer.set()
        _, params = sched.request_finished(r, ([],))
        report = TurnReport.from_params(params)
        assert report is not None and report.store_errors == 1 and report.loaded_tokens == 0
    finally:
        answer.set()
        sched.shutdown()


def test_a_turn_loads_the_previous_turns_tail_page_and_computes_only_new_tokens(
    store: Store, side: SchedulerSide
) -> None:
    """The previous turn ended 2 tokens into its third block: its tail page is offered, vLLM
    admits a count that is not a whole number of pages, and the worker copies 3 blocks."""
    tenant = store.identity.tenant_for("u")
    prev = list(range(300, 300 + 2 * BS + 2))
    r1 = request("r1", [*prev, 9], tenant)  # the last sampled token (9) has no KV yet
    r1.num_computed_tokens = len(prev)
    assert side.request_finished(r1, ([20, 21, 22],))[0]
    (save,) = step(side).saves
    assert save.page_indexes == (0, 1, 2) and save.block_ids == ((20, 21, 22),) and save.tail_tokens == 2
    # The worker's copy, as the store sees it: the reserved slots are written, then committed.
    written = [*pages_for(SMALL_FP, np.asarray(prev, dtype=np.int32)), bytes(SMALL_FP.page_nbytes)]
    write_slots(store, save, written)
    assert store.kv.saves.commit_save(save.save_id, save.page_indexes) == 3
    side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))

    nxt = request("r2", [*prev, 9, 7, 7, 7], tenant)
    assert side.get_num_new_matched_tokens(nxt, 0) == (2 * BS + 2, False)
    side.update_state_after_alloc(nxt, blocks_of([1, 2, 3, 4]), 2 * BS + 2)
    (load,) = step(side).loads
    assert load.block_ids == ((1, 2, 3),) and load.span is not None and len(load.span.slots) == 3
    nxt.num_computed_tokens = len(nxt.all_token_ids) - 1
    _, params = side.request_finished(nxt, ([1, 2, 3, 4],))
    report = TurnReport.from_params(params)
    assert (
        report is not None
        and report.loaded_tokens == 2 * BS + 2
        and report.loaded_from == {"host": 2 * BS + 2}
    )
    step(side)


def test_a_worker_turning_the_connector_off_is_said_in_every_later_report(
    store: Store, side: SchedulerSide
) -> None:
    # Before: the scheduler logged one line ("a DSS worker turned the connector off") and the
    # server went on serving uncached while /readyz and dss_kv_caching_enabled said caching was on.
    tenant = store.identity.tenant_for("u")
    tokens = stored(store, tenant, 2 * BS)
    r1 = request("r1", [*tokens, 1], tenant)
    r1.num_computed_tokens = 0
    _, params = side.request_finished(r1, ([],))
    assert params is not None and params["caching_off"] == ""
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=DSSWorkerMetadata({}, True)))
    r2 = request("r2", [*tokens, 2], tenant, session_id="s2")
    assert side.get_num_new_matched_tokens(r2, 0) == (0, False)  # no more loads
    r2.num_computed_tokens = 2 * BS + 1
    done, params = side.request_finished(r2, ([1, 2, 3],))
    assert not done and params is not None  # no more saves
    report = TurnReport.from_params(params)
    assert report is not None and "does not match the fingerprint" in report.caching_off
