"""A KV-aware router's side of vLLM's KV events, for the tests of `engine_patch.connector.kv_events`

- `Subscriber`: a ZMQ SUB socket on a vLLM publisher; every frame `[topic, seq, payload]` is
  decoded with vLLM's own msgspec class (`KVEventBatch`), sequence numbers checked.
- `Holdings`: what each publisher (topic) holds per (block hash, medium), rebuilt from the events
  only (`AllBlocksCleared` empties the publisher's view, as routers do).
- `DynamoIndex`: NVIDIA Dynamo's own indexer (`ai-dynamo-runtime`, `ensure_dynamo_runtime`).
- `LlmdIndex`: llm-d's precise prefix-cache index reproduced from its source
  (llm-d/llm-d-kv-cache, `pkg/kvcache/kvblock/token_processor.go`, `pkg/kvevents/pool.go`): its
  own block keys are FNV-64a over the canonical CBOR of `[parent, tokens, extra]`, chained from
  `FNV-64a(CBOR([FNV-64a(seed), None, model]))`; a `BlockStored` is indexed under the keys it
  recomputes from `token_ids`, chained from the key its `parent_block_hash` maps to (an unknown
  parent drops the event); `extra_keys` count only as `(mm_hash, offset)` pairs (a cache salt is
  not part of its key); `BlockRemoved` evicts (pod, medium) from the keys its engine hashes map
  to. A request is scored per pod over the longest run of its leading blocks the pod holds,
  each block weighted by the best medium the pod holds it on (`kvblock_scorer.go`: llm-d's
  defaults gpu 1.0 and cpu 0.8, plus `storage` as docs/operations.md configures it; a medium
  without a weight counts 1.0).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import cbor2
import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DSS_MEDIA = ("CPU", "STORAGE")
# llm-d's default weights (`kvblock/backend.go`: gpu 1.0, cpu 0.8) and the one DSS's disk needs
TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.4, "shared_storage": 0.4}


class Subscriber:
    """Connects to a publisher that binds (more with `sock.connect`), or binds `endpoint` for
    publishers that connect to it (`bind=True`)."""

    def __init__(self, endpoint: str, topic: bytes = b"", *, bind: bool = False) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq: dict[bytes, int] = {}

    def receive(self, timeout_s: float) -> list[tuple[str, KVEventBatch]]:
        """Every batch that arrives within `timeout_s` (sequence numbers checked per topic)."""
        out: list[tuple[str, KVEventBatch]] = []
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            topic, seq_bytes, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            assert seq == self.last_seq.get(topic, -1) + 1, "a batch was lost on the socket"
            self.last_seq[topic] = seq
            out.append((topic.decode(), self._decoder.decode(payload)))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


class Holdings:
    """Per topic: the (block hash, medium) pairs of DSS's media, stored minus removed."""

    def __init__(self) -> None:
        self.held: dict[str, set[tuple[int | bytes, str]]] = defaultdict(set)
        self.tokens: dict[int | bytes, tuple[int, ...]] = {}
        self.cleared: dict[str, int] = defaultdict(int)
        self.stored = 0
        self.removed = 0

    def apply(self, topic: str, batch: KVEventBatch) -> None:
        view = self.held[topic]
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                view.clear()
                self.cleared[topic] += 1
            elif isinstance(ev, BlockStored) and ev.medium in DSS_MEDIA:
                assert ev.locality == "LOCAL" and ev.block_size * len(ev.block_hashes) == len(ev.token_ids)
                for i, h in enumerate(ev.block_hashes):
                    assert (h, ev.medium) not in view, "stored twice without a removal"
                    view.add((h, ev.medium))
                    self.tokens[h] = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                self.stored += 1
            elif isinstance(ev, BlockRemoved) and ev.medium in DSS_MEDIA:
                for h in ev.block_hashes:
                    assert (h, ev.medium) in view, "removed without being stored"
                    view.discard((h, ev.medium))
                self.removed += 1


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class LlmdIndex:
    def __init__(
        self, block_size: int, model: str, hash_seed: str = "", media: Sequence[str] | None = None
    ) -> None:
        self.media = media  # None: every medium; DSS_MEDIA: DSS's pages only (not vLLM's own blocks)
        self.block_size = block_size
        self.model = model
        self.init_hash = self._hash(fnv64a(hash_seed.encode()), None, model)
        self.engine_to_request: dict[int | bytes, int] = {}
        self.pods: dict[int, set[tuple[str, str]]] = defaultdict(set)  # request key -> {(pod, tier)}

    @staticmethod
    def _hash(parent: int, tokens: Sequence[int] | None, extra: object) -> int:
        payload = [parent, list(tokens) if tokens is not None else None, extra]
        return fnv64a(cbor2.dumps(payload, canonical=True))

    def keys(self, tokens: Sequence[int], parent: int | None = None) -> list[int]:
        prefix = self.init_hash if parent is None else parent
        out = []
        for i in range(0, len(tokens) - self.block_size + 1, self.block_size):
            prefix = self._hash(prefix, tokens[i : i + self.block_size], None)
            out.append(prefix)
        return out

    def apply(self, pod: str, batch: KVEventBatch) -> None:
        media = self.media
        for ev in batch.events:
            if media is not None and not isinstance(ev, AllBlocksCleared) and ev.medium not in self.media:
                continue  # another medium (vLLM's own blocks)
            if isinstance(ev, BlockStored):
                tier = (ev.medium or "gpu").lower()
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self.engine_to_request.get(ev.parent_block_hash)
                    if parent is None:
                        continue  # llm-d drops a block whose parent it does not know
                request_keys = self.keys(ev.token_ids, parent)
                if len(request_keys) != len(ev.block_hashes):
                    continue  # DSS publishes at the engine's block size: always 1:1
                for engine_key, request_key in zip(ev.block_hashes, request_keys, strict=True):
                    self.engine_to_request[engine_key] = request_key
                    self.pods[request_key].add((pod, tier))
            elif isinstance(ev, BlockRemoved):
                tier = (ev.medium or "gpu").lower()
                for engine_key in ev.block_hashes:
                    key = self.engine_to_request.get(engine_key)
                    if key is not None:
                        self.pods[key].discard((pod, tier))

    def scores(self, tokens: Sequence[int]) -> dict[str, float]:
        """Per pod: the weighted length of the leading blocks of `tokens` it holds."""
        scores: dict[str, float] = defaultdict(float)
        active: set[str] | None = None
        for key in self.keys(tokens):
            best: dict[str, float] = {}
            for pod, tier in self.pods.get(key, ()):
                best[pod] = max(best.get(pod, 0.0), TIER_WEIGHTS.get(tier, 1.0))  # unconfigured: 1.0
            active = set(best) if active is None else active & set(best)
            if not active:
                break
            for pod in active:
                scores[pod] += best[pod]
        return dict(scores)

    def pick(self, tokens: Sequence[int]) -> str | None:
        scores = self.scores(tokens)
        return max(scores, key=lambda p: scores[p]) if scores else None


# NVIDIA Dynamo's runtime, for its KV indexer only (not a DSS dependency): installed without its
# dependencies, outside the checkout, on first use (a 75 MB wheel; it runs offline).
DYNAMO_RUNTIME = "ai-dynamo-runtime==1.6.1"


def dynamo_runtime_dir() -> Path:
    default = Path.home() / ".cache" / "dss" / "test-deps" / DYNAMO_RUNTIME.replace("==", "-")
    return Path(os.environ.get("DSS_DYNAMO_RUNTIME_DIR", default))


def ensure_dynamo_runtime() -> None:
    """Make `dynamo._core` importable: the installed one, else `DYNAMO_RUNTIME` installed with
    `pip --no-deps --target` into `dynamo_runtime_dir()` (once) and appended to `sys.path`.
    Raises RuntimeError with pip's reason when it cannot be had."""
    with contextlib.suppress(ImportError):
        import dynamo._core  # noqa: F401

        return
    target = dynamo_runtime_dir()
    if not (target / "dynamo").is_dir():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        r = subprocess.run([*pip, "--target", str(partial), DYNAMO_RUNTIME],
                           capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"installing {DYNAMO_RUNTIME} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    if str(target) not in sys.path:
        sys.path.append(str(target))


class DynamoIndex:
    """NVIDIA Dynamo's own KV indexer (`dynamo._core.RadixTree`, from `ai-dynamo-runtime` on PyPI;
    it runs offline) fed with the events as Dynamo's KV events are shaped: per worker, event ids
    1, 2, 3, ...; a stored block is its engine hash (`block_hash`) with Dynamo's own hash of its
    tokens (`tokens_hash`: `compute_block_hash_for_seq` at the block size), chained by
    `parent_hash`; `cleared` drops the worker's blocks. One tree per DSS tier (`host_pinned` for
    `CPU`, `disk` for `STORAGE`): a request scores each worker by its best tier, the matched
    leading blocks times that tier's credit (Dynamo's router: host 0.75, disk 0.25)."""

    TIER_OF = {"CPU": "host_pinned", "STORAGE": "disk"}
    CREDIT = {"host_pinned": 0.75, "disk": 0.25}

    def __init__(self, block_size: int) -> None:
        ensure_dynamo_runtime()
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        self._local_hashes = compute_block_hash_for_seq
        self.block_size = block_size
        self.trees = {tier: RadixTree() for tier in self.CREDIT}
        self.worker_ids: dict[str, int] = {}
        self.event_ids: dict[tuple[str, int], int] = defaultdict(int)
        self.skipped_removals = 0

    def _apply(self, tier: str, worker: int, data: object) -> None:
        self.event_ids[tier, worker] += 1
        event = {"event_id": self.event_ids[tier, worker], "data": data}
        try:
            self.trees[tier].apply_event(worker, json.dumps(event).encode())
        except RuntimeError as exc:
            # Dynamo's router logs and skips the removal of a block it no longer has (a removed
            # ancestor took it along); its Python binding raises instead.
            if "removed" not in data or "Failed to find block" not in str(exc):  # type: ignore[operator]
                raise
            self.skipped_removals += 1

    def apply(self, pod: str, batch: KVEventBatch) -> None:
        worker = self.worker_ids.setdefault(pod, len(self.worker_ids) + 1)
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                for tier in self.trees:
                    self._apply(tier, worker, "cleared")
            elif isinstance(ev, BlockStored) and ev.medium in self.TIER_OF:
                local = self._local_hashes(list(ev.token_ids), ev.block_size)
                blocks = [
                    {"block_hash": h, "tokens_hash": t} for h, t in zip(ev.block_hashes, local, strict=True)
                ]
                stored = {"parent_hash": ev.parent_block_hash, "blocks": blocks}
                self._apply(self.TIER_OF[ev.medium], worker, {"stored": stored})
            elif isinstance(ev, BlockRemoved) and ev.medium in self.TIER_OF:
                removed = {"block_hashes": list(ev.block_hashes)}
                self._apply(self.TIER_OF[ev.medium], worker, {"removed": removed})

    def scores(self, tokens: Sequence[int]) -> dict[str, float]:
        local = self._local_hashes(list(tokens), self.block_size)
        pods = {w: p for p, w in self.worker_ids.items()}
        out: dict[str, float] = {}
        for tier, tree in self.trees.items():
            for (worker, _dp_rank), n in tree.find_matches(local).scores.items():
                pod = pods[worker]
                out[pod] = max(out.get(pod, 0.0), self.CREDIT[tier] * n)
        return {p: s for p, s in out.items() if s > 0}

    def pick(self, tokens: Sequence[int]) -> str | None:
        scores = self.scores(tokens)
        return max(scores, key=lambda p: scores[p]) if scores else None
