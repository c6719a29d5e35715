"""The scheduler half of the DSS connector (runs in vLLM's engine-core process).

It decides, per request, how many prompt tokens beyond vLLM's own prefix-cache hit can be
loaded from the store, pins those pages until the worker has copied them, and when a request
finishes asks the store which of its pages are new and hands their copy to the worker. A
request's last, partial block is saved too, as a tail page (the whole block, valid for its first
tokens), and loaded into the block vLLM allocates for it, so that the next turn of a session
computes only its new tokens: vLLM accepts a matched-token count that is not a multiple of the
block size and computes the rest of that block itself.

Only requests whose `kv_transfer_params` carry a `dss.wire.SessionTag` (set by our server, never
by an end client) are touched; every other request is left exactly to plain vLLM. Every store
failure (an error, or an RPC past its deadline) is a cache miss, never an error of the request;
each one is counted in the request's `dss.wire.TurnReport`.

Store round trips per session turn from this process: one `begin_load` when the request is first
scheduled (unless vLLM's own cache covers all but the last prompt token, or the request came with
a load the API's store planned before sending it, `SessionTag.planned_load`: then none, and one
`release` only when vLLM's own cache already held everything it planned), one `plan_save` when
its prefill completes (its whole prompt pages; none when the load brought them all: a plan's pages
and every page before them were pinned in the store), and one `plan_save` at finish (the pages
decoding completed and the tail; none when the store held all of them when the load was planned,
`LoadPlan.stored_tokens`: a prompt seen before whose answer is one token).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from dss.errors import DSSError
from dss.namespace import ModelFingerprint
from dss.rpc import StoreClient
from dss.types import FingerprintId, Tier
from dss.wire import LoadPlan, PageSlot, SessionTag, TurnReport, span_of, tokens_digest
from engine_patch.connector.groups import KVGroups, complete_prefix
from engine_patch.connector.metadata import DSSConnectorMetadata, DSSWorkerMetadata, LoadSpec, SaveSpec
from engine_patch.connector.request_state import BlockIds, Claim, RequestState, session_key, tokens_by_tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.dss_connector")

# How long the scheduler remembers when each session's last save landed: a load planned longer
# ago than this is not taken (a plan is made the moment before its request is sent).
_SAVES_REMEMBERED_S = 60.0


class SchedulerSide:
    def __init__(
        self,
        fingerprint: ModelFingerprint | None,
        client: StoreClient | None,
        *,
        settle_timeout_s: float = 2.0,
        save_after_prefill: bool = True,
        block_ids_of: Callable[[str], BlockIds] | None = None,
        tag_key: bytes | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.client = client
        self._tag_key = tag_key
        self.block_size = fingerprint.block_size if fingerprint is not None else 0
        self.groups = KVGroups.parse(fingerprint.kv_groups, fingerprint.num_layers) if fingerprint else None
        # Why the connector does not load or save ("" while it does): sent back in every turn's
        # report (`TurnReport.caching_off`), so the API process says so in /readyz and /metrics.
        self.off_reason = (
            "the engine's KV cache cannot be described by a fingerprint (see the engine log)"
            if fingerprint is None
            else "the connector has no store address"
            if client is None or tag_key is None
            else ""
        )
        self._forged_seen: set[str] = set()  # plain requests whose unsigned tag was already logged
        self.settle_timeout_s = settle_timeout_s
        self.save_after_prefill = save_after_prefill and block_ids_of is not None
        self._block_ids_of = block_ids_of
        self._fid: FingerprintId | None = None
        self._requests: dict[str, RequestState] = {}  # running session requests, by request id
        # session -> {request id: when its finish-time save was handed to the worker}; kept past
        # the request's finish, until the worker reports the copy done.
        self._saving: dict[tuple[str, str], dict[str, float]] = {}
        # session -> when the engine last saw one of its saves land (oldest first, for
        # `_saved_since`): a load planned before then may lack that save's pages.
        self._saved_at: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        # Registered at start so the store (and the API beside it) knows this engine's pages; a
        # store that is down now is retried at the first session request.
        self._fingerprint_id()

    def session_of(self, request: Request) -> SessionTag | None:
        """The DSS session a request belongs to; None for a plain vLLM request, and for a tag
        whose signature does not verify (a client of this engine setting `kv_transfer_params`
        itself: it must not name a tenant, so the request runs uncached)."""
        if self._tag_key is None:
            return None
        params = request.kv_transfer_params
        tag = SessionTag.from_params(params, self._tag_key)
        if (
            tag is None
            and request.request_id not in self._forged_seen
            and SessionTag.forged(params, self._tag_key)
        ):
            self._forged_seen.add(request.request_id)
            logger.warning("request %s carries an unsigned DSS session tag; ignored", request.request_id)
        return tag

    # ------------------------------------------------------------------ store access
    def fingerprint_id(self) -> FingerprintId | None:
        """The fingerprint id the store registered for this engine (None while it cannot tell,
        and once the connector is off)."""
        return None if self.disabled else self._fingerprint_id()

    def _fingerprint_id(self) -> FingerprintId | None:
        if self._fid is None and not self.disabled:
            assert self.client is not None and self.fingerprint is not None
            try:
                self._fid = self.client.register_fingerprint(self.fingerprint)
            except DSSError as exc:
                logger.warning("DSS store unavailable, serving without it for now: %s", exc)
                return None
            if self._fid != self.fingerprint.id:
                self._turn_off(f"the store registered fingerprint {self.fingerprint.id} as {self._fid}")
                return None
        return self._fid

    def _release(self, st: RequestState, load_id: str) -> None:
        if self.client is None:
            return
        try:
            self.client.release(load_id)
        except DSSError as exc:
            st.store_errors += 1
            logger.warning("DSS release of load %s failed: %s", load_id, exc)

    # ------------------------------------------------------------------ vLLM hooks
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.disabled:
            return 0, False
        req_id = request.request_id
        st = self._requests.get(req_id)
        if st is None:
            session = self.session_of(request)
            if session is None:
                return 0, False
            st = self._requests[req_id] = self._new_state(request, session)
        st.engine_cached = num_computed_tokens
        if st.claim is not None:
            if st.claim.start_token == num_computed_tokens:
                return st.claim.plan.n_tokens, self._is_async(st.claim.plan)
            # vLLM's own cache moved under us: the old plan no longer starts where we load.
            self._drop_claim(st)
        if self._save_in_flight(session_key(st.session)):
            # A previous turn of this session is still being saved (its pages are copied in the
            # next engine step); ask again then, so the new turn sees them. Bounded, in case the
            # save never completes.
            if st.deferred_since is None:
                st.deferred_since = time.monotonic()
            # A load planned before this save landed may lack its pages: asked again below.
            self._drop_planned(st)
            if time.monotonic() - st.deferred_since < self.settle_timeout_s:
                return None, False
        st.deferred_since = None
        # A sync hit must leave at least one token to compute (the scheduler asserts it); async
        # hits may not, but one rule for both keeps the plan valid whichever the store answers.
        # The limit need not be a whole page: a tail page may end anywhere before it.
        max_tokens = request.num_tokens - 1
        if max_tokens <= num_computed_tokens:
            self._drop_planned(st)
            return 0, False
        if st.planned is not None and (taken := self._take_planned(st, num_computed_tokens, max_tokens)):
            return taken
        fid = self._fingerprint_id()
        if fid is None:
            return 0, False
        try:
            # The whole sequence, not only what may be loaded: the plan says how far the store
            # holds it, which spares asking to save what it has (`RequestState.planned_tokens`).
            plan = self.client.begin_load(  # type: ignore[union-attr]
                fid, st.session.tenant, request.all_token_ids, num_computed_tokens, max_tokens
            )
        except DSSError as exc:
            st.store_errors += 1
            logger.warning("DSS lookup for %s failed, recomputing: %s", req_id, exc)
            return 0, False
        if plan is None:
            return 0, False
        if not self._plan_is_sane(plan, num_computed_tokens, max_tokens):
            self._release(st, plan.load_id)
            return 0, False
        st.claim = Claim(plan, num_computed_tokens)
        st.found_in = {k: v for k, v in plan.tier_tokens.items() if v}
        return plan.n_tokens, self._is_async(plan)

    def _new_state(self, request: Request, session: SessionTag) -> RequestState:
        assert self._tag_key is not None  # a session was verified with it
        return RequestState(
            request,
            session,
            saves_prompt=self.save_after_prefill and request.num_output_tokens == 0,
            windowed=bool(self.groups and self.groups.windowed) and self._block_ids_of is not None,
            planned=session.planned_load(request.kv_transfer_params, self._tag_key),
        )

    def _take_planned(self, st: RequestState, start: int, max_tokens: int) -> tuple[int, bool] | None:
        """Answer the lookup with the load planned before the request came (for its whole prompt,
        from the first token), less the pages vLLM's own cache already holds: the store is not
        asked again. (0, False): nothing left to load. None: the plan does not fit this engine or
        this request, and the store is asked. Its lease is the sender's to end, used or not: the
        engine makes no store round trip for it."""
        given, st.planned = st.planned, None
        assert given is not None
        planned, bs = given.plan, self.block_size
        skip = start // bs
        if (
            given.fingerprint != self._fingerprint_id()
            or planned.start_token != 0
            or start % bs
            or given.prompt != tokens_digest(st.request.prompt_token_ids or ())
            or self._saved_since(session_key(st.session), given.planned_at)
        ):
            return None
        if skip >= len(planned.pages):  # vLLM's own cache holds all the store held
            return 0, False
        plan = planned  # from the first page (vLLM's cache held none of it): as the store made it
        if skip:
            pages = planned.pages[skip:]
            n_tokens = planned.n_tokens - skip * bs
            tiers = tokens_by_tier(_tiers_of(pages), n_tokens, bs)
            plan = replace(planned, n_tokens=n_tokens, start_token=start, pages=pages, tier_tokens=tiers)
        if not self._plan_is_sane(plan, start, max_tokens):
            return None
        st.claim = Claim(plan, start, skip, planned=True)
        st.planned_ahead = True
        st.found_in = {k: v for k, v in plan.tier_tokens.items() if v}
        return plan.n_tokens, self._is_async(plan)

    def _saved_since(self, key: tuple[str, str], planned_at: float) -> bool:
        """Whether a save of the session landed after a load of it was planned (the plan may
        lack its pages: the store is asked again), or the plan is too old to tell."""
        now = time.monotonic()
        horizon = now - _SAVES_REMEMBERED_S
        while self._saved_at and next(iter(self._saved_at.values())) < horizon:
            self._saved_at.popitem(last=False)
        return planned_at < horizon or self._saved_at.get(key, -math.inf) >= planned_at

    @staticmethod
    def _drop_planned(st: RequestState) -> None:
        """Forget the plan the request came with (its sender ends the lease)."""
        st.planned = None

    def _is_async(self, plan: LoadPlan) -> bool:
        """Whether the worker copies the plan's pages on its loader thread, before the request is
        scheduled: a plan with pages to promote, and every load of a hybrid model, because vLLM
        takes a load failure there only for a whole asynchronous request (`failed_recving`),
        never for single blocks of a synchronous one."""
        return plan.is_async or (self.groups is not None and self.groups.hybrid)

    def _save_in_flight(self, key: tuple[str, str]) -> bool:
        """Whether a recent save of this session is still being copied. A save not reported done
        within `settle_timeout_s` (a worker that died, say) stops holding the session back."""
        saves = self._saving.get(key)
        if not saves:
            return False
        horizon = time.monotonic() - self.settle_timeout_s
        for req_id in [r for r, t in saves.items() if t < horizon]:
            del saves[req_id]
        if not saves:
            del self._saving[key]
            return False
        return True

    def _plan_is_sane(self, plan: LoadPlan, start: int, max_tokens: int) -> bool:
        bs = self.block_size
        first = start // bs
        ok = (
            plan.n_tokens > 0
            and (len(plan.pages) - 1) * bs < plan.n_tokens <= len(plan.pages) * bs
            and start + plan.n_tokens <= max_tokens
            and [p.page_index for p in plan.pages] == list(range(first, first + len(plan.pages)))
            and (plan.is_async or span_of(plan.pages) is not None)
        )
        if not ok:
            logger.error("DSS store answered an inconsistent load plan %s; ignoring it", plan.load_id)
        return ok

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._requests.get(request.request_id)
        if st is None or st.claim is None:
            return  # not ours, or the second call after an async load
        claim, st.claim = st.claim, None
        bs = self.block_size
        # The last page may be partial (a tail page, or vLLM taking fewer tokens than offered):
        # its whole block is copied, and vLLM computes the block's remaining positions.
        n_pages = min(-(-num_external_tokens // bs), len(claim.plan.pages))
        if n_pages == 0:
            self._end_claim(st, claim)
            return
        first = claim.start_token // bs
        # Per group; a sliding-window group's blocks below the window of the load's end are the
        # null block (vLLM holds nothing there) and are not copied.
        block_ids = tuple(tuple(ids[first : first + n_pages]) for ids in blocks.get_block_ids())
        pages = claim.plan.pages[:n_pages]
        is_async = self._is_async(claim.plan)
        # Pages in the host arena name their slots now, whichever way vLLM takes the load.
        span = None if claim.plan.is_async else span_of(pages)
        self._loads.append(
            LoadSpec(
                st.req_id,
                claim.plan.load_id,
                block_ids,
                span,
                is_async,
                claim.skip_pages,
                release_lease=not claim.planned,
            )
        )
        # The tier the plan names for each page: the host arena, a page promoted on the way (disk,
        # or the fleet's remote tier), or one the store has just read from the remote tier into
        # the host arena for this turn (a prefetch: reported as remote, where its KV came from).
        st.page_tiers = _tiers_of(pages)
        st.loaded_tokens = min(num_external_tokens, claim.plan.n_tokens)
        # The store held every whole page up to the load's end (it pinned them to plan it), and,
        # when vLLM took the whole plan, the sequence as far as `stored_tokens`: no save needs to
        # ask about those again (a hot turn with a one-token answer asks nothing at finish).
        held = claim.plan.stored_tokens if st.loaded_tokens == claim.plan.n_tokens else 0
        end = (claim.start_token + st.loaded_tokens) // bs * bs
        st.planned_tokens = max(st.planned_tokens, end, min(held, request.num_tokens))
        st.loading_async = is_async
        per_tier = tokens_by_tier(st.page_tiers, st.loaded_tokens, bs)
        st.hit_sources = {
            source: n
            for source, n in (
                (CacheHitSource.HOST, per_tier.get(Tier.HOST.value, 0)),
                (CacheHitSource.DISK, per_tier.get(Tier.DISK.value, 0)),
                # vLLM has no name for a shared tier
                (CacheHitSource.EXTERNAL_UNSPECIFIED, per_tier.get(Tier.REMOTE.value, 0)),
            )
            if n
        }

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        st = self._requests.get(request.request_id)
        sources = st.hit_sources if st is not None else {}
        if st is not None:
            st.hit_sources = {}
        if not num_external_tokens:
            return {}
        return sources or {CacheHitSource.HOST: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DSSConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for st in [s for r, s in self._requests.items() if r in scheduled and (s.saves_prompt or s.windowed)]:
            if st.saves_prompt:
                self._save_finished_prefill(st, scheduled[st.req_id])
            if st.windowed:
                self._save_pages_leaving_windows(st, scheduled[st.req_id])
        meta = DSSConnectorMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        return meta

    def _save_finished_prefill(self, st: RequestState, n_scheduled: int) -> None:
        """Save the prompt pages of a request whose prefill completes in this step.

        The worker copies them after this step's forward, so the next turn, a branch or a
        concurrent request of the session can use them before the answer is complete (and they
        survive an abort). At finish only the decode pages are left to save.
        """
        request = st.request
        if request.num_computed_tokens + n_scheduled < request.num_prompt_tokens:
            return  # chunked prefill: not the last chunk yet
        st.saves_prompt = False
        assert self._block_ids_of is not None
        # Whole pages only: the prompt's last block fills up while the answer is decoded and
        # is saved at finish (with the answer's own tail).
        n_whole = request.num_prompt_tokens // self.block_size * self.block_size
        self._queue_save(st, self._plan_save(st, n_whole, self._block_ids_of(st.req_id), on_finish=False))

    def _save_pages_leaving_windows(self, st: RequestState, n_scheduled: int) -> None:
        """Save the whole pages of a running request whose oldest unsaved page loses its
        sliding-window blocks at the next step (vLLM frees the blocks below the window of the
        tokens computed by then): a page is stored only with every group's KV, so this is its last
        chance. One save covers all whole pages computed by the end of this step, so a long
        answer costs one store round trip per window of tokens."""
        assert self.groups is not None and self._block_ids_of is not None
        bs = self.block_size
        n_after = min(st.request.num_computed_tokens + n_scheduled, len(st.request.all_token_ids))
        first_unsaved = st.planned_tokens // bs
        if max(g.skipped_tokens(n_after) // bs for g in self.groups.windowed) <= first_unsaved:
            return
        self._queue_save(
            st, self._plan_save(st, n_after // bs * bs, self._block_ids_of(st.req_id), on_finish=False)
        )

    def _queue_save(self, st: RequestState, spec: SaveSpec | None) -> None:
        if spec is not None:
            self._saves.append(spec)
            st.stored_pages += len(spec.page_indexes)

    def _plan_save(
        self, st: RequestState, n_tokens: int, block_ids: BlockIds, on_finish: bool
    ) -> SaveSpec | None:
        """Ask the store which pages of the first `n_tokens` tokens it lacks (whole pages, then
        the tail page when `n_tokens` ends inside a block); None when there is nothing to copy.
        Only pages with every KV cache group's block are saved (see `engine_patch.connector.groups`)."""
        fid = self._fingerprint_id()
        bs = self.block_size
        n_tokens = min(n_tokens, len(block_ids[0]) * bs)
        if n_tokens <= st.planned_tokens or fid is None or self.disabled:
            return None  # nothing beyond what an earlier plan of this request covered
        try:
            plan = self.client.plan_save(  # type: ignore[union-attr]
                fid, st.session.tenant, st.request.all_token_ids[:n_tokens], n_tokens // bs, with_tail=True
            )
        except DSSError as exc:
            st.store_errors += 1
            logger.warning("DSS plan_save for %s failed; not saved: %s", st.req_id, exc)
            return None
        st.planned_tokens = n_tokens
        if not plan.pages:
            return None  # the store has every page already
        span = span_of(plan.pages)
        if span is None:
            logger.error("DSS save plan %s came without usable slots; aborting it", plan.save_id)
            self._abort(st, plan.save_id)
            return None
        indexes = tuple(p.page_index for p in plan.pages)
        # A page a sliding-window group no longer holds a block of is not saved, nor anything
        # after it (the store releases the slots of pages a commit leaves out).
        n_complete = complete_prefix(block_ids, indexes)
        if n_complete == 0:
            self._abort(st, plan.save_id)
            return None
        if n_complete < len(indexes):
            indexes = indexes[:n_complete]
            span = replace(span, slots=span.slots[:n_complete], generations=span.generations[:n_complete])
        tail = n_tokens % bs if indexes[-1] == n_tokens // bs else 0  # the tail page is planned too
        return SaveSpec(
            st.req_id,
            plan.save_id,
            indexes,
            tuple(tuple(ids[i] for i in indexes) for ids in block_ids),
            span,
            on_finish,
            tail_tokens=tail,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            if (st := self._requests.get(req_id)) is not None:
                st.loading_async = False
        for req_id in output.finished_sending or ():
            for key in [k for k, ids in self._saving.items() if req_id in ids]:
                del self._saving[key][req_id]
                if not self._saving[key]:
                    del self._saving[key]
                self._saved_at[key] = time.monotonic()
                self._saved_at.move_to_end(key)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, DSSWorkerMetadata):
            for req_id, n in meta.failed_tokens.items():
                if (st := self._requests.get(req_id)) is not None:
                    st.failed_tokens += n
                    # A page that failed its check may be gone from the store (replaced while it
                    # was copied): what the load said the store held no longer counts, so the
                    # finish asks about every token and the recomputed pages are saved again.
                    st.planned_tokens = 0
            if meta.disabled and not self.disabled:
                self._turn_off("a worker's KV cache does not match the fingerprint (see the engine log)")

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._forged_seen.discard(req_id)
        st = self._requests.pop(req_id, None)
        if st is None:
            session = self.session_of(request)
            if session is None:
                return False, None
            st = self._new_state(request, session)  # finished before the connector was asked
        self._drop_claim(st)
        delay_free = False
        # Aborted while its pages were still arriving: its blocks hold nothing to save yet.
        # Otherwise every computed token is saved: whole pages and the tail page.
        if not st.loading_async and not self.disabled:
            spec = self._plan_save(st, int(request.num_computed_tokens), block_ids, on_finish=True)
            if spec is not None:
                self._queue_save(st, spec)
                self._saving.setdefault(session_key(st.session), {})[req_id] = time.monotonic()
                delay_free = True
        return delay_free, self._report(st).to_params()

    def _report(self, st: RequestState) -> TurnReport:
        fid = self.fingerprint.id if self.fingerprint is not None else None
        return st.report(self.block_size, fid, self.off_reason)

    @property
    def disabled(self) -> bool:
        return bool(self.off_reason)

    def _turn_off(self, reason: str) -> None:
        logger.error("DSS connector off: %s; no more loads or saves", reason)
        self.off_reason = reason

    def _abort(self, st: RequestState, save_id: str) -> None:
        try:
            self.client.abort_save(save_id)  # type: ignore[union-attr]
        except DSSError as exc:
            st.store_errors += 1
            logger.warning("DSS abort_save %s failed: %s", save_id, exc)

    def shutdown(self) -> None:
        for st in self._requests.values():
            self._drop_claim(st)
        if self.client is not None:
            self.client.close()

    def _drop_claim(self, st: RequestState) -> None:
        self._drop_planned(st)
        claim, st.claim = st.claim, None
        if claim is not None:
            self._end_claim(st, claim)

    def _end_claim(self, st: RequestState, claim: Claim) -> None:
        """Release a claim's lease, unless its sender planned it (and ends it)."""
        if not claim.planned:
            self._release(st, claim.plan.load_id)


def _tiers_of(pages: tuple[PageSlot, ...]) -> list[str]:
    """The tier each page of a plan is read from (a plan's pages name it; an old store's did not)."""
    return [p.tier or (Tier.HOST.value if p.slot is not None else Tier.DISK.value) for p in pages]
