"""Retention hints vs plain LRU at a fixed host capacity, on a real store (no engine), side by side.

A skewed workload of chat sessions, one user each, replayed identically on two stores that differ
only in retention: a few hot sessions take most turns, many occasional ones come back now and
then and are closed after a few turns, and some turns roll back (regenerate an answer: the head
moves back and a new version grows from there, leaving the old one off every branch). Each turn
loads the session head's history (`tests.store_helpers.load_sequence`, promoting disk pages like an engine
load) and saves the new pages (`put_sequence`); the tokens of that history are counted as served
from the host tier, from disk, or missed, by where their pages were when the turn arrived.

- `lru`: eviction policy `lru`, no hints.
- `policy`: eviction policy `lru` under the retention classes, with the hints a front end would
  give: hot sessions `pinned` (within the default caps), closed sessions `evict`, and the sweeper's
  reclassification (orphan pages of rolled-back versions go first) every few turns.

    .venv/bin/python bench/retention.py [--turns N] [--host-pages N] [--seed N]

Last line: RESULT hit_ratio_policy=… hit_ratio_lru=…
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.config import RetentionConfig, StoreConfig
from dss.errors import PinnedCapExceeded
from dss.namespace import ModelFingerprint
from dss.store import Store
from dss.types import FingerprintId, Tier
from tests.store_helpers import load_sequence, put_sequence

FP = ModelFingerprint(
    model_id="bench-retention", revision="r1", dtype="bfloat16",
    num_layers=2, num_kv_heads=2, head_size=16, block_size=16,
)  # fmt: skip
BS = FP.block_size


@dataclass
class Sess:
    user: str
    sid: str
    hot: bool
    tokens: dict[int, np.ndarray] = field(default_factory=dict)  # version -> its tokens
    head: int = 0
    turns: int = 0
    closed: bool = False


@dataclass
class Op:
    """One step of the workload, the same for both runs."""

    kind: str  # "turn", "rollback", "close", "open"
    session: int
    back: int = 0  # rollback: versions to go back
    new_pages: int = 2


@dataclass
class Tally:
    host: int = 0
    disk: int = 0
    missed: int = 0
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        total = self.host + self.disk + self.missed
        return self.host / total if total else 0.0


def workload(turns: int, seed: int, hot: int, occasional: int) -> tuple[list[Op], list[bool]]:
    """The ops, and for each session index whether it is hot. Hot sessions live for `hot_life`
    turns, then close and a new hot one opens; occasional ones close after 3-6 turns."""
    rng = random.Random(seed)
    kinds: list[bool] = []
    ops: list[Op] = []
    live_hot: list[int] = []
    live_occ: list[int] = []
    left: dict[int, int] = {}

    def open_session(is_hot: bool) -> int:
        kinds.append(is_hot)
        i = len(kinds) - 1
        ops.append(Op("open", i))
        left[i] = rng.randint(10, 14) if is_hot else rng.randint(3, 6)
        (live_hot if is_hot else live_occ).append(i)
        return i

    for _ in range(hot):
        open_session(True)
    for _ in range(occasional):
        open_session(False)
    for _ in range(turns):
        pool = live_hot if rng.random() < 0.7 else live_occ
        i = rng.choice(pool)
        if left[i] < 12 and rng.random() < 0.2:
            ops.append(Op("rollback", i, back=rng.randint(1, 2)))
        ops.append(Op("turn", i, new_pages=rng.randint(1, 3)))
        left[i] -= 1
        if left[i] <= 0:
            ops.append(Op("close", i))
            pool.remove(i)
            open_session(kinds[i])
    return ops, kinds


def run(root: Path, ops: list[Op], kinds: list[bool], host_pages: int, hints: bool) -> Tally:
    cfg = StoreConfig(
        data_dir=root, fsync=False, codec_process=False, eviction_policy="lru",
        host_capacity_bytes=host_pages * FP.page_nbytes, disk_capacity_bytes=1 << 30,
        retention=RetentionConfig(sweep_interval_s=0.0),
    )  # fmt: skip
    tally = Tally()
    page = bytes(FP.page_nbytes)
    counter = 1
    with Store.open(cfg) as store:
        fid = FingerprintId(store.fingerprints.register(FP))
        sessions: dict[int, Sess] = {}
        began = time.perf_counter()
        for n, op in enumerate(ops):
            if op.kind == "open":
                s = Sess(f"user{op.session}", f"s{op.session}", kinds[op.session])
                sessions[op.session] = s
                store.versions.create_session(s.user, s.sid)
                system = np.arange(counter, counter + 2 * BS, dtype=np.int32)  # its own system prompt
                counter += 2 * BS
                s.tokens[0] = system
                if hints and s.hot:
                    with contextlib.suppress(PinnedCapExceeded):  # over the caps: stays normal
                        store.retention.set_hint(s.user, s.sid, "pinned")
                continue
            s = sessions[op.session]
            if op.kind == "close":
                s.closed = True
                if hints:
                    store.retention.set_hint(s.user, s.sid, "evict")
                continue
            if op.kind == "rollback":
                if s.head == 0:
                    continue
                target = s.head
                for _ in range(op.back):
                    parent = store.versions.get_version(s.user, s.sid, target, with_body=False).parent
                    if parent is None:
                        break
                    target = parent
                if target != s.head and target != 0:
                    store.versions.rollback(s.user, s.sid, "main", target)
                    s.head = target
                continue
            tenant = store.identity.tenant_for(s.user)
            history = s.tokens[s.head]
            m = store.kv.match(fid, tenant, history)
            for h in m.pages:
                tier = store.pages.fastest_tier(h)
                if tier is Tier.HOST:
                    tally.host += BS
                elif tier is Tier.DISK:
                    tally.disk += BS
                else:
                    tally.missed += BS
            tally.missed += len(history) - len(m.pages) * BS
            load_sequence(store, fid, tenant, history)
            new = np.arange(counter, counter + op.new_pages * BS, dtype=np.int32)
            counter += op.new_pages * BS
            tokens = np.concatenate([history, new])
            put_sequence(store, fid, tenant, tokens, [page] * (len(tokens) // BS))
            v = store.versions.commit(
                s.user, s.sid, tokens=tokens, messages=[{"role": "user", "content": str(n)}], fingerprint=fid
            )
            s.tokens[v.number] = tokens
            s.head = v.number
            if hints and n % 10 == 0:
                store.retention.sweeper.sweep()  # what the sweeper does every few seconds
        tally.seconds = time.perf_counter() - began
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=1500)
    ap.add_argument("--host-pages", type=int, default=128)
    ap.add_argument("--hot", type=int, default=6)
    ap.add_argument("--occasional", type=int, default=150)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.turns, args.host_pages, args.occasional = 100, 32, 20
    ops, kinds = workload(args.turns, args.seed, args.hot, args.occasional)
    results: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="dss-bench-retention-") as tmp:
        for name, hints in (("lru", False), ("policy", True)):
            results[name] = run(Path(tmp) / name, ops, kinds, args.host_pages, hints)
            t = results[name]
            print(
                f"{name:>6}: host {t.host} disk {t.disk} missed {t.missed} tokens, "
                f"host hit ratio {t.ratio:.3f} ({t.seconds:.1f} s)"
            )
    p, lru = results["policy"], results["lru"]
    print(
        f"RESULT hit_ratio_policy={p.ratio:.3f} hit_ratio_lru={lru.ratio:.3f} "
        f"turns={args.turns} host_pages={args.host_pages}"
    )


if __name__ == "__main__":
    main()
