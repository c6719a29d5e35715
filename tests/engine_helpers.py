"""Builders shared by the engine tests: the prepared default model, a store serving RPC, a vLLM
engine wired to it, and multi-turn conversations built on token ids.

Conversations are kept as token ids: turn k+1's prompt is turn k's prompt + its output + the
next user message's template tokens, exactly what a server that remembers token ids sends.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dss.config import StoreConfig
from dss.ops.kv import KVCache
from dss.store import Store
from dss.types import FingerprintId
from dss.wire import KV_TRANSFER_PARAMS, PlannedLoad, SessionTag
from engine_patch.setup.factory import EngineSettings, build_llm, session_params, tag_key
from engine_patch.setup.model import default_data_dir, find_model, pull_model, resolve_model

IM_END = "<|im_end|>"

WORDS = [
    "river",
    "stone",
    "garden",
    "lamp",
    "winter",
    "orange",
    "market",
    "story",
    "engine",
    "cloud",
    "paper",
    "window",
    "silver",
    "forest",
    "harbor",
    "violin",
    "candle",
    "mountain",
    "letter",
    "bridge",
    "meadow",
    "clock",
    "thunder",
    "pepper",
    "circle",
    "anchor",
    "velvet",
    "museum",
    "planet",
    "ribbon",
    "cactus",
    "falcon",
    "glacier",
    "lantern",
    "marble",
    "nectar",
    "orchid",
    "pebble",
    "quartz",
    "saddle",
    "tunnel",
    "umbrella",
    "vessel",
    "walnut",
    "yogurt",
    "zephyr",
    "canyon",
    "dolphin",
    "ember",
    "fjord",
    "grotto",
    "hazel",
    "island",
]


def model_path() -> Path:
    """`find_model` (`$DSS_MODEL_DIR` when set, else a prepared default model); with none prepared
    and no `$DSS_MODEL_DIR`, the default model is pulled into the data dir."""
    env = os.environ.get("DSS_MODEL_DIR")
    if env:
        return resolve_model(env, default_data_dir())  # raises, naming the folder, when it is not a model
    return find_model() or pull_model(default_data_dir(), progress=False)


def open_store(data_dir: Path, host_gib: float = 1.0) -> Store:
    return Store.open(
        StoreConfig(data_dir=data_dir, fsync=False, host_capacity_bytes=int(host_gib * (1 << 30)))
    )


def settings(**overrides: Any) -> EngineSettings:
    base: dict[str, Any] = {"model": model_path(), "max_model_len": 4096, "kv_cache_space_gib": 1}
    base.update(overrides)
    return EngineSettings(**base)


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


@dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    params: dict[str, Any] | None
    num_cached_tokens: int

    @property
    def loaded_tokens(self) -> int:
        return int((self.params or {}).get("loaded_tokens", 0))


class Engine:
    """A vLLM `LLM` wired to a store, with batch helpers on token-id prompts.

    `deterministic_batches=True` runs vLLM's engine core in this process. vLLM's CPU kernels are
    not batch-invariant, and with the engine core in its own process the requests of one
    `generate` call trickle in while it already steps, so two runs of one batch can be scheduled
    differently and differ in the last bits. In-process, every request is queued before the
    first step and the schedule is a function of the inputs alone. With one rank the worker runs
    in this process too (vLLM's single-process executor): a start takes ~3-6 s instead of ~25-30 s
    on 2 cores (no interpreter spawned to import vLLM), and the connector's two halves share this
    process; their metadata crossing processes is what the served engines (`dss serve`) and
    parallel engines check. Such an engine steps only inside `generate`: `settle` runs the
    saves a finished request left.
    """

    def __init__(
        self,
        address: str | None,
        authkey: bytes | None,
        deterministic_batches: bool = False,
        **overrides: Any,
    ) -> None:
        self.settings = settings(**overrides)
        self.authkey = authkey
        self.planner: KVCache | None = None
        self._planned: list[PlannedLoad] = []  # sent, their leases not ended yet (`drop_planned`)
        self.fingerprint: FingerprintId | None = None  # as the connector reports it
        key = "VLLM_ENABLE_V1_MULTIPROCESSING"
        old = os.environ.get(key)
        self.in_process = deterministic_batches
        if deterministic_batches:
            os.environ[key] = "0"
        try:
            self.llm = build_llm(address, authkey, self.settings)
        finally:
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        self.tokenizer = self.llm.get_tokenizer()

    def session(self, tenant: str, session_id: str) -> dict[str, Any]:
        """The signed session tag of a request (the connector ignores unsigned ones)."""
        assert self.authkey is not None, "a session request needs the store's authkey"
        return session_params(self.authkey, tenant, session_id)

    def plan_loads(self, planner: KVCache | None) -> None:
        """Plan each session request's load in the store before sending it, as `dss serve` does
        (`KVCache.plan_ahead`), once the connector has reported the fingerprint it registered."""
        self.planner = planner

    def planned(self, prompt: Sequence[int], session: dict[str, Any] | None) -> dict[str, Any] | None:
        """`session` with the load of `prompt` planned in (when a planner is set)."""
        if session is None or self.planner is None or self.fingerprint is None or self.authkey is None:
            return session
        key = tag_key(self.authkey)
        tag = SessionTag.from_params(session.get(KV_TRANSFER_PARAMS), key)
        if tag is None:
            return session
        plan = self.planner.plan_ahead(self.fingerprint, tag.tenant, prompt)
        if plan is not None:
            self._planned.append(plan)
        return tag.extra_args(key, plan)

    def drop_planned(self) -> None:
        """End the leases of the loads planned since the last call, once their requests are
        answered (a plan's lease is its sender's to end, as `dss serve` does)."""
        planned, self._planned = self._planned, []
        if self.planner is not None:
            for plan in planned:
                self.planner.drop_planned(plan)

    def note_report(self, params: dict[str, Any] | None) -> None:
        """Follow the fingerprint the connector reports (what the API does, `generate`)."""
        reported = (params or {}).get("fingerprint")
        if reported:
            self.fingerprint = FingerprintId(str(reported))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sessions: Sequence[dict[str, Any] | None],
        max_tokens: int | Sequence[int] = 24,
    ) -> list[Result]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sessions = [self.planned(p, s) for p, s in zip(prompts, sessions, strict=True)]
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, extra_args=s or None)
            for s, m in zip(sessions, limits, strict=True)
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        try:
            outs = self.llm.generate(inputs, params, use_tqdm=False)
        finally:
            self.drop_planned()
        for o in outs:
            self.note_report(o.kv_transfer_params)
        return [
            Result(
                list(o.prompt_token_ids or []),
                list(o.outputs[0].token_ids),
                o.outputs[0].text,
                o.kv_transfer_params,
                int(o.num_cached_tokens or 0),
            )
            for o in outs
        ]

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Empty vLLM's own prefix cache (retrying while delayed-free saves still hold blocks)."""
        deadline = time.monotonic() + timeout_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's prefix cache could not be reset")
            self.settle()
            time.sleep(0.01)

    def settle(self) -> None:
        """Let the engine finish pending saves. An in-process engine core steps only inside
        `generate`; one idle step runs the worker's save copies and frees their blocks."""
        if self.in_process:
            self.llm.llm_engine.step()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def user_turn_ids(self, text: str) -> list[int]:
        """Template tokens that close the assistant's turn and open the next user turn."""
        return list(
            self.tokenizer(
                f"\n<|im_start|>user\n{text}{IM_END}\n<|im_start|>assistant\n", add_special_tokens=False
            )["input_ids"]
        )

    def continue_ids(self, prompt: Sequence[int], output: Sequence[int], user_text: str) -> list[int]:
        im_end = self.tokenizer.convert_tokens_to_ids(IM_END)
        tail = list(output) if output and output[-1] == im_end else [*output, im_end]
        return [*prompt, *tail, *self.user_turn_ids(user_text)]

    def close(self) -> None:
        """Shut the engine's processes down (so the next engine gets the CPU and memory), once an
        engine in this process ran the saves its finished requests left (`settle`)."""
        try:
            self.settle()
        finally:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None:
                core.shutdown()
            del self.llm
            gc.collect()


@dataclass
class Conversation:
    """A scripted dialogue: a first message set and the user texts of the later turns."""

    name: str
    first: list[dict[str, str]]
    followups: list[str]
    max_tokens: int = 24
    session_id: str = field(default_factory=lambda: "s-" + uuid.uuid4().hex[:12])


def make_conversations(n: int, seed: int = 7) -> list[Conversation]:
    """`n` conversations of 3+ turns with mixed lengths; a third are longer than 3 blocks at turn 1."""
    rng = np.random.default_rng(seed)
    convs = []
    for i in range(n):
        long = i % 3 == 0
        first_len = int(rng.integers(350, 520)) if long else int(rng.integers(15, 160))
        first = [
            {
                "role": "user",
                "content": f"Conversation {i}. Read these words and list three of them: "
                f"{words(rng, first_len)}",
            }
        ]
        if i % 4 == 1:
            first.insert(0, {"role": "system", "content": f"You are assistant number {i}. {words(rng, 40)}"})
        followups = [
            f"Now say something about {rng.choice(WORDS)} and {words(rng, int(rng.integers(5, 120)))}"
            for _ in range(2 + (i % 2))
        ]
        convs.append(Conversation(f"c{i}", first, followups, max_tokens=int(rng.integers(12, 40))))
    return convs


def served_by(stored: Sequence[Sequence[int]], prompt: Sequence[int]) -> int:
    """What DSS serves of `prompt` when the tenant stored the KV of the sequences `stored`: the
    longest prefix it shares with any of them (whole pages, then a tail page or the next whole
    page, either usable for any prefix of its tokens), leaving at least one token to compute."""
    best = 0
    for seq in stored:
        n = min(len(seq), len(prompt))
        diff = np.flatnonzero(np.asarray(seq[:n]) != np.asarray(prompt[:n]))
        best = max(best, int(diff[0]) if len(diff) else n)
    return min(best, len(prompt) - 1)


def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
