"""The API plans a session turn's load before it sends the request (`api.llm.generation`): the
plan rides signed with the request, its lease is held until the first token is back and then
ended by the API (the engine makes no store round trip for it), and a request the engine never
answered leaves no lease behind (against a real store; the engine is a stand-in, a vLLM
`AsyncLLM` needs CUDA or minutes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError

from api.http_errors import BadRequest
from api.llm.chat_engine import ChatEngine
from api.llm.generation import generate
from api.llm.sampling import Sampling
from dss.store import Store
from dss.types import SessionId, UserId
from dss.wire import KV_TRANSFER_PARAMS, SessionTag, tokens_digest
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

KEY = b"k" * 32
ANA = UserId("ana")


class StandInEngine:
    """`AsyncLLM.generate` as the API uses it: records each request's parameters (and the
    store's leases then: `leases_at`), then fails before any output (`fail_first`) or answers one
    finished token."""

    def __init__(self, fail_first: bool, leases: Any = None) -> None:
        self.fail_first = fail_first
        self.params: list[Any] = []
        self.leases = leases
        self.leases_at: list[int] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.params.append(params)
        if self.leases is not None:
            self.leases_at.append(self.leases())
        if self.fail_first:
            raise VLLMClientError("the engine refused the request")
        done = SimpleNamespace(
            index=0, text="x", token_ids=[7], logprobs=None, finish_reason="stop", stop_reason=None
        )
        yield SimpleNamespace(outputs=[done], num_cached_tokens=0, kv_transfer_params=None)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = open_store(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


def turn(store: Store, fail_first: bool) -> tuple[StandInEngine, ChatEngine, list[int]]:
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for(ANA)
    tokens = np.arange(1, 4 * SMALL_FP.block_size + 1, dtype=np.int32)
    put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
    llm = StandInEngine(fail_first, lambda: store.kv.stats()["leases"])
    engine = ChatEngine(
        llm, None, model_name="m", max_model_len=4096, fingerprint=fid, max_inflight=4, retry_after_s=1,
        tag_key=KEY, planner=store.kv,
    )  # fmt: skip
    return llm, engine, [*tokens.tolist(), 99]


async def run(engine: ChatEngine, store: Store, prompt: list[int]) -> list[Any]:
    sampling = Sampling(max_tokens=1, n=1, params=SamplingParams(max_tokens=1), logprobs=None)
    tenant = store.identity.tenant_for(ANA)
    gen = generate(
        engine, prompt, sampling, tenant=tenant, cache_salt="s", session_id=SessionId("s1"), arrived=0.0
    )
    return [ev async for ev in gen]


def test_a_turns_load_is_planned_and_sent_signed_with_it(store: Store) -> None:
    llm, engine, prompt = turn(store, fail_first=False)
    asyncio.run(run(engine, store, prompt))
    (params,) = llm.params
    sent = params.extra_args[KV_TRANSFER_PARAMS]
    tag = SessionTag.from_params(sent, KEY)
    assert tag is not None and tag.session_id == "s1"
    planned = tag.planned_load(sent, KEY)
    assert planned is not None and planned.fingerprint == SMALL_FP.id
    assert planned.prompt == tokens_digest(prompt) and planned.plan.n_tokens == 4 * SMALL_FP.block_size
    # Pinned while the engine copies; its first token back, the API ended the lease (the
    # engine's workers never release a planned load).
    assert llm.leases_at == [1]
    assert store.kv.stats()["leases"] == 0


def test_a_request_the_engine_never_answered_leaves_no_lease(store: Store) -> None:
    llm, engine, prompt = turn(store, fail_first=True)
    with pytest.raises(BadRequest):
        asyncio.run(run(engine, store, prompt))
    assert len(llm.params) == 1 and store.kv.stats()["leases"] == 0
