"""The worker half of the DSS connector (runs in vLLM's worker process, beside the KV tensors).

Loads: sync loads are copied in `start_load_kv`, before the forward that needs them; async loads
(pages the store promotes from disk) run on a loader thread that waits for the store, copies, and
reports the request finished-receiving. Saves: a finished request's new pages are copied into the
slots the store reserved, then committed. Any failure in a load reports the affected blocks, and
vLLM recomputes them (`kv_load_failure_policy="recompute"`); any failure in a save aborts it. The
request itself never fails because of the store.

Every copy out of the arena is validated after it is taken, against the generation of each slot:
the store bumps it before a slot's bytes change and when the page in it stops being valid (dropped,
moved, erased: `dss.pages.placement.copies`), so a page erased or dropped while it was being copied
is not taken, and its block and those after it are recomputed. A load copied on the forward pass's
thread therefore needs no store round trip: the lease of a load its request's sender planned is
the sender's to end, and any other is ended by the releasing thread.
Store round trips per turn from this process: none for a planned load from the host tier, one
release on the releasing thread for another, two on the loader thread for an async load (wait for
the promotion, then validate and release), and one `commit_save` per save plan.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from vllm.logger import init_logger

from dss.errors import DSSError
from dss.namespace import ModelFingerprint
from dss.rpc import StoreClient
from dss.wire import span_of, usable_prefix
from engine_patch.connector.copy import ArenaViews, KVBlocks
from engine_patch.connector.fingerprint import UnsupportedKVCache, check_layer_tensors
from engine_patch.connector.groups import KVGroups, group_runs
from engine_patch.connector.layouts import layout_for, physical_order
from engine_patch.connector.metadata import (
    DSSConnectorMetadata,
    DSSWorkerMetadata,
    LoadSpec,
    SaveSpec,
    SlotSpan,
)

logger = init_logger("vllm.dss_connector")

_FINISHED_MEMORY = 8192  # finished request ids remembered in case a save completes after them


@dataclass(frozen=True, slots=True)
class EngineRank:
    """Where this worker sits in a parallel engine: which KV heads (tensor-parallel rank) and
    which layers (pipeline stage) of every page it copies."""

    tp_rank: int = 0
    pp_rank: int = 0

    def shard(self, fp: ModelFingerprint) -> int:
        """This rank's number among the `fp.shards` that each report every load and save."""
        return self.pp_rank * fp.tp_size + self.tp_rank


def order_layers(
    kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]
) -> dict[int, torch.Tensor]:
    """The KV tensors by model layer index: pages are layer-major by layer index."""
    indexed = [(layer_index(name), name) for name in kv_caches]
    if len({i for i, _ in indexed}) != len(indexed):
        raise UnsupportedKVCache("two KV layers share a layer index")
    return {i: kv_caches[name] for i, name in sorted(indexed)}


class WorkerSide:
    def __init__(
        self,
        fingerprint: ModelFingerprint | None,
        client_factory: Callable[[], StoreClient] | None,
        num_blocks: int,
        *,
        load_timeout_s: float = 30.0,
        allow_uncached: bool = False,
    ) -> None:
        self.fingerprint = fingerprint
        self.allow_uncached = allow_uncached
        self.num_blocks = num_blocks
        self.load_timeout_s = load_timeout_s
        self.disabled = fingerprint is None or client_factory is None
        # Which layers of a page each KV cache group holds (one group: all of them).
        self.groups = KVGroups.parse(fingerprint.kv_groups, fingerprint.num_layers) if fingerprint else None
        self._client = client_factory() if client_factory is not None else None
        # The loader thread blocks in `wait_loaded`; it gets its own connection so the main
        # thread's commits never queue behind it. So does the releasing thread.
        self._loader_client = client_factory() if client_factory is not None else None
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-async-load")
        self._release_client = client_factory() if client_factory is not None else None
        self._to_release: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        # A thread of its own, started with the worker (below), not an executor's: an executor
        # starts its thread at the first submit, on the forward pass's thread, and that start
        # waited 0.2-1.1 s for a core on a loaded machine (`bench/engine_hot.py --smoke`, s51).
        self._releaser = threading.Thread(target=self._release_loop, name="dss-release", daemon=True)
        self._lock = threading.Lock()
        self.blocks: KVBlocks | None = None
        self.views: ArenaViews | None = None
        self.shard = 0  # this rank's shard of every page (set with the KV caches)
        self._async_done: list[tuple[str, list[int], int]] = []  # req id, failed blocks, failed tokens
        self._load_errors: set[int] = set()
        # Loads that failed in a hybrid model: vLLM takes no block-level failures with several
        # KV cache groups, only whole requests (`failed_recving`), which it recomputes.
        self._failed_recving: set[str] = set()
        self._failed_tokens: dict[str, int] = {}
        self._saved: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._disabled_reported = False
        self.stats = {"loaded_pages": 0, "failed_pages": 0, "saved_pages": 0, "aborted_saves": 0}
        self._releaser.start()

    # ------------------------------------------------------------------ setup
    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_index: Callable[[str], int],
        rank: EngineRank | None = None,
    ) -> None:
        fp = self.fingerprint
        if fp is None:
            return
        rank = rank or EngineRank()
        # Known before anything can fail: a worker that turns itself off still reports its
        # shard of every load and save, so the other ranks' pages are not held until expiry.
        self.shard = rank.shard(fp)
        try:
            if not (0 <= rank.tp_rank < fp.tp_size and 0 <= rank.pp_rank < fp.pp_size):
                raise UnsupportedKVCache(f"{rank} is outside the engine's {fp.tp_size}x{fp.pp_size} ranks")
            layers = order_layers(kv_caches, layer_index)
            blocks = KVBlocks(
                layers,
                layout_for(fp, self.num_blocks),
                num_layers=fp.num_layers,
                segment=rank.tp_rank,
                segments=fp.tp_size,
            )
            views = dict(zip(blocks.layer_indexes, blocks.views, strict=True))
            check_layer_tensors(fp, views, self.num_blocks)
            self.blocks = blocks
        except (UnsupportedKVCache, DSSError) as exc:
            if not self.allow_uncached:
                # The engine fails to start rather than serve uncached with one log line here.
                raise UnsupportedKVCache(
                    f"DSS cannot cache this engine: its KV cache does not match the fingerprint ({exc}) "
                    "(DSS_ENGINE__ALLOW_UNCACHED=true serves it without caching)"
                ) from None
            logger.error(
                "DSS connector off in this worker: the KV cache does not match the fingerprint (%s)", exc
            )
            self.disabled = True
            return
        self.views = ArenaViews(fp.num_layers, fp.layer_row_nbytes, pin=blocks.on_cuda)
        logger.info(
            "DSS connector ready (%s, shard %d of %d): %d layers x %d blocks of %s (in memory %s), "
            "pages of %s blocks, %d bytes",
            rank,
            self.shard,
            fp.shards,
            len(layers),
            self.num_blocks,
            tuple(blocks.layers[0].shape[1:]),
            physical_order(blocks.layers[0], blocks.layout),
            "packed" if blocks.layout.packed else f"{blocks.block_shape} (H, N, C)",
            fp.page_nbytes,
        )

    @property
    def ready(self) -> bool:
        return not self.disabled and self.blocks is not None and self.views is not None

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: DSSConnectorMetadata) -> None:
        """Copy what is in the host arena now, on this thread; leave a load whose pages the
        store is still promoting (no slots yet) to the loader thread. A hybrid model's loads are
        asynchronous to vLLM (`_is_async` on the scheduler side) but most have their slots: copied
        here, before this step's forward, they are reported done by this step's `get_finished`,
        so the request runs in the next step, with no hand-off to the loader thread (a GIL switch
        interval, 5 ms, and more steps while it waits for it: the 9x hot loads of issue 31)."""
        for spec in meta.loads:
            if spec.span is None:
                self._loader.submit(self._load_promoted, spec)
            else:
                self._load_in_place(spec, spec.span)

    def _copy_in(self, span: SlotSpan, block_ids: tuple[tuple[int, ...], ...]) -> int:
        """Copy slots into blocks; returns how many pages, from the first, are still the pages
        the store named once the copy is done (their slots' generations did not move). A slot
        released and reused meanwhile may hold another page, another tenant's even: the pages
        from there on are misses whatever the store's validation says."""
        assert self.blocks is not None and self.views is not None and self.groups is not None
        arena = self.views.attached(span.arena_path, span.slot_nbytes)
        for layers, run_list in group_runs(self.groups, block_ids, span.slots):
            # One group is every layer: None keeps the whole-page copy (one DMA per run on CUDA).
            self.blocks.load(arena.pages, run_list, layers if self.groups.hybrid else None)
        unchanged = arena.unchanged(span.slots, span.generations)  # after the copy, never before
        if unchanged < len(span.slots):
            logger.warning(
                "DSS load: slot %d of %s changed while it was copied; recomputing from page %d",
                span.slots[unchanged],
                span.arena_path,
                unchanged,
            )
        return unchanged

    def _load_in_place(self, spec: LoadSpec, span: SlotSpan) -> None:
        """A load whose plan named every slot, on the forward pass's thread: copy and check the
        copies against the slots' generations. The lease is ended by the request's sender (a
        planned load: `LoadSpec.release_lease`) or else by the releasing thread. A store round
        trip here cost a hot turn 0.3 ms of a ~6 ms reference, and a thread that makes it during
        the forward pass about as much (issue 31)."""
        kind = "async" if spec.is_async else "sync"
        n_ok = 0
        try:
            if not self.ready:
                raise DSSError("connector not ready for loads")
            n_ok = min(self._copy_in(span, spec.block_ids), spec.n_pages)
        except Exception as exc:
            logger.warning(
                "DSS %s load %s for %s failed, recomputing: %s", kind, spec.load_id, spec.req_id, exc
            )
        if spec.release_lease:
            self._to_release.put(spec.load_id)
        self._record_load(spec, n_ok, async_done=spec.is_async)

    def _release_loop(self) -> None:
        """The releasing thread: ends the leases of loads copied on the forward pass's thread,
        in order, on a connection of its own (a failure is logged; the store expires the lease)."""
        while (load_id := self._to_release.get()) is not None:
            self._release(self._release_client, load_id, self.shard)

    def _load_promoted(self, spec: LoadSpec) -> None:
        """An async load on the loader thread: wait for the store to promote the pages and name
        their slots, copy, then validate the copies and release the lease in one round trip;
        any failure is a miss from the first page not known good, recomputed by vLLM."""
        client = self._loader_client
        n_ok = 0
        released = False
        try:
            if not self.ready or client is None or not spec.is_async:
                raise DSSError("connector not ready for loads")
            got = client.wait_loaded(spec.load_id, self.load_timeout_s)
            skip = spec.skip_pages
            # Usable from the lease's first page: one missing before `skip` fails the whole load.
            n_ok = max(0, min(usable_prefix(got[: skip + spec.n_pages]) - skip, spec.n_pages))
            got = got[skip:]
            if n_ok < spec.n_pages:
                logger.warning(
                    "DSS async load %s for %s: %d of %d pages could not be had, recomputing from page %d",
                    spec.load_id,
                    spec.req_id,
                    spec.n_pages - n_ok,
                    spec.n_pages,
                    n_ok,
                )
            span = span_of(got[:n_ok]) if n_ok else None
            if n_ok and span is None:
                raise DSSError("promoted pages came back without slots in one arena")
            if n_ok and span is not None:
                n_copied = self._copy_in(span, tuple(ids[:n_ok] for ids in spec.block_ids))
                valid = client.release_checked(spec.load_id, shard=self.shard) - skip
                released = True
                n_ok = max(0, min(n_copied, valid, n_ok))
        except Exception as exc:
            logger.warning("DSS async load %s for %s failed, recomputing: %s", spec.load_id, spec.req_id, exc)
            n_ok = 0
        finally:
            if not released:
                self._release(client, spec.load_id, self.shard)
        self._record_load(spec, n_ok, async_done=True)

    def _record_load(self, spec: LoadSpec, n_ok: int, async_done: bool) -> None:
        if n_ok < spec.n_pages and self.groups is not None and self.groups.hybrid:
            n_ok = 0  # reported as a failed request, which vLLM recomputes whole
        n_failed = spec.n_pages - n_ok
        failed_blocks = list(spec.block_ids[0][n_ok:])
        with self._lock:
            self.stats["loaded_pages"] += n_ok
            self.stats["failed_pages"] += n_failed
            if async_done:
                self._async_done.append((spec.req_id, failed_blocks, n_failed))
            elif failed_blocks:
                self._load_errors.update(failed_blocks)
                self._failed_tokens[spec.req_id] = self._failed_tokens.get(spec.req_id, 0) + len(
                    failed_blocks
                )

    @staticmethod
    def _release(client: StoreClient | None, load_id: str, shard: int) -> None:
        if client is None:
            return
        try:
            client.release(load_id, shard=shard)
        except DSSError as exc:
            logger.warning("DSS release of load %s failed: %s", load_id, exc)

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: DSSConnectorMetadata) -> None:
        for spec in meta.saves:
            self._save(spec)

    def _save(self, spec: SaveSpec) -> None:
        try:
            if not self.ready or self._client is None:
                raise DSSError("connector not ready for saves")
            assert self.blocks is not None and self.views is not None
            assert self.groups is not None
            pages = self.views.pages(spec.span.arena_path, spec.span.slot_nbytes)
            for layers, run_list in group_runs(self.groups, spec.block_ids, spec.span.slots):
                self.blocks.save(pages, run_list, layers if self.groups.hybrid else None)
            written = spec.page_indexes
            if spec.tail_tokens and not self._scrub_tail(pages, spec):
                written = written[:-1]  # the store releases the tail's slot unpublished
            self._client.commit_save(spec.save_id, written, shard=self.shard)
            self.stats["saved_pages"] += len(written)
        except Exception as exc:
            logger.warning("DSS save %s for %s failed; aborted: %s", spec.save_id, spec.req_id, exc)
            self.stats["aborted_saves"] += 1
            if self._client is not None:
                try:
                    self._client.abort_save(spec.save_id, shard=self.shard)
                except DSSError as abort_exc:
                    logger.warning("DSS abort_save %s failed: %s", spec.save_id, abort_exc)
        if spec.on_finish:
            self._saved.add(spec.req_id)

    def _scrub_tail(self, pages: torch.Tensor, spec: SaveSpec) -> bool:
        """Zero the positions of the tail page's block that its sequence has not reached (they
        hold KV of the block's previous user). False when that cannot be done here: the tail
        page is then not saved."""
        assert self.blocks is not None and self.fingerprint is not None
        isa = self.fingerprint.isa.removeprefix("cpu-")  # the CPU kernel's, for packed blocks
        try:
            self.blocks.scrub_after(
                pages, spec.span.slots[-1], spec.tail_tokens, isa, self.fingerprint.kv_cache_dtype
            )
        except Exception as exc:
            logger.warning("DSS save %s: cannot clear its tail page, not saving it: %s", spec.save_id, exc)
            return False
        return True

    # ------------------------------------------------------------------ per-step reporting
    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self._finished[req_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        sending = {r for r in self._saved if r in self._finished}
        self._saved -= sending
        for r in sending:
            self._finished.pop(r, None)
        with self._lock:
            done, self._async_done = self._async_done, []
            for req_id, failed_blocks, n_failed in done:
                if not n_failed:
                    continue
                self._failed_tokens[req_id] = self._failed_tokens.get(req_id, 0) + n_failed
                if self.groups is not None and self.groups.hybrid:
                    self._failed_recving.add(req_id)
                else:
                    self._load_errors.update(failed_blocks)
        recving = {req_id for req_id, _, _ in done}
        return (sending or None), (recving or None)

    def take_failed_recving(self) -> set[str]:
        """Requests whose (async) load failed in a hybrid model: vLLM recomputes them whole."""
        with self._lock:
            failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> DSSWorkerMetadata | None:
        """Failed pages are reported in blocks; the scheduler learns them in tokens (for the response)."""
        bs = self.fingerprint.block_size if self.fingerprint is not None else 0
        with self._lock:
            failed, self._failed_tokens = self._failed_tokens, {}
        report_disabled = self.disabled and not self._disabled_reported
        if not failed and not report_disabled:
            return None
        self._disabled_reported |= report_disabled
        return DSSWorkerMetadata({r: n * bs for r, n in failed.items()}, self.disabled)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=False)
        self._to_release.put(None)  # after the leases queued before it
        self._releaser.join(timeout=self._release_client.timeout_s if self._release_client else 0)
        if self.views is not None:
            self.views.close()
        for client in (self._client, self._loader_client, self._release_client):
            if client is not None:
                client.close()
