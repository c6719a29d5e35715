"""Builders shared by the store tests: a small fingerprint, page bytes, an open store."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sqlalchemy import Engine, text

from dss.config import StoreConfig
from dss.errors import PageShapeMismatch
from dss.namespace import ModelFingerprint
from dss.store import Store
from dss.tokens import as_tokens
from dss.types import FingerprintId, TenantId

SMALL_FP = ModelFingerprint(
    model_id="tiny-test",
    revision="r1",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    block_size=4,
)


def page_bytes(fp: ModelFingerprint, seed: int) -> bytes:
    """Deterministic KV-like page content (bf16 bit patterns of small normal values)."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(fp.page_nbytes // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def pages_for(fp: ModelFingerprint, tokens: np.ndarray, salt: int = 0) -> list[bytes]:
    """Page i's bytes depend on the tokens up to and including page i, like real KV."""
    bs = fp.block_size
    out = []
    for i in range(len(tokens) // bs):
        seed = zlib.crc32(np.ascontiguousarray(tokens[: (i + 1) * bs]).tobytes()) + salt
        out.append(page_bytes(fp, seed))
    return out


def put_sequence(
    store: Store,
    fid: FingerprintId,
    tenant: TenantId,
    tokens: Sequence[int] | np.ndarray,
    pages: Sequence[bytes | memoryview],
) -> int:
    """Store pages for `tokens` as an engine would (plan, copy into the slots, commit): page i =
    bytes of block i; when `tokens` end inside the last page, that page is stored as their tail
    page. Returns the new pages stored."""
    fp = store.fingerprints.get(fid)
    for p in pages:
        if len(p) != fp.page_nbytes:
            raise PageShapeMismatch(f"page of {len(p)} bytes; fingerprint {fid} needs {fp.page_nbytes}")
    n_tokens = len(as_tokens(tokens))
    with_tail = n_tokens % fp.block_size != 0 and len(pages) == n_tokens // fp.block_size + 1
    n_whole = len(pages) - 1 if with_tail else len(pages)
    plan = store.kv.plan_save(fid, tenant, tokens, n_whole, with_tail=with_tail)
    for ps in plan.pages:
        assert ps.slot is not None
        store.pages.host.slot_array(ps.slot)[:] = np.frombuffer(pages[ps.page_index], dtype=np.uint8)
    return store.kv.saves.commit_save(plan.save_id, [ps.page_index for ps in plan.pages])


def load_sequence(
    store: Store, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
) -> tuple[int, list[bytes]]:
    """Load `tokens` as an engine would: tokens matched (a tail page counts its valid tokens)
    and a copy of each matched page's bytes (stops at a failed page), validated after they are
    taken."""
    plan = store.kv.begin_load(fid, tenant, tokens)
    if plan is None:
        return 0, []
    copies: list[bytes] = []
    try:
        for ps in store.kv.loads.wait_loaded(plan.load_id):
            if ps is None or ps.slot is None:
                break
            copies.append(store.pages.host.slot_array(ps.slot).tobytes())
    finally:
        valid = store.kv.loads.release_checked(plan.load_id)
    n = min(valid, len(copies))
    return min(n * store.fingerprints.get(fid).block_size, plan.n_tokens), copies[:n]


def open_store(data_dir: Path, **overrides: object) -> Store:
    options: dict[str, object] = {"fsync": False, "host_capacity_bytes": 1 << 24, **overrides}
    cfg = StoreConfig(data_dir=data_dir, **options)  # type: ignore[arg-type]
    return Store.open(cfg)


def disk_only_store(data_dir: Path) -> tuple[np.ndarray, list[bytes]]:
    """Alice's 10 pages of 40 tokens stored, then the store closed: they are on disk only."""
    store = open_store(data_dir)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    tokens = np.arange(1, 41, dtype=np.int32)  # 10 pages
    pages = pages_for(SMALL_FP, tokens)
    put_sequence(store, fid, tenant, tokens, pages)
    store.close()  # flushes write-through; the host tier is gone after this
    return tokens, pages


# ---------------------------------------------------------------------------- concurrency stress
# Shared by tests/dss/test_store_stress.py and bench/store_concurrency.py (one copy of the logic).

STRESS_USERS = 4
STRESS_HOST_PAGES = 16  # 4 workers x at most 3 pages in flight each: no CapacityError is legitimate
STRESS_DISK_PAGES = 24
DISK_PAGE_FILE_BYTES = 620  # measured: 618 B per SMALL_FP page file (512 B raw + header + AEAD)
_BS = SMALL_FP.block_size
STRESS_SEQUENCES: tuple[np.ndarray, ...] = tuple(
    np.asarray(s, dtype=np.int32)
    for s in (
        list(range(1, 13)),  # 3 pages
        [*range(1, 9), 50, 51, 52, 53],  # shares 2 pages with the first
        list(range(200, 208)),  # 2 pages, its own
        [*range(1, 5), *range(300, 308)],  # shares page 0 with the first
    )
)


def open_stress_store(data_dir: Path) -> Store:
    """Tiny tiers so that host eviction and disk eviction happen all the time, fsync on."""
    return open_store(
        data_dir,
        fsync=True,
        host_capacity_bytes=STRESS_HOST_PAGES * SMALL_FP.page_nbytes,
        disk_capacity_bytes=STRESS_DISK_PAGES * DISK_PAGE_FILE_BYTES,
    )


def stress_salt(user: int, generation: int) -> int:
    """Page-byte salt: differs per user (cross-tenant leaks show) and per erase generation."""
    return 1_000_003 * generation + 101 * user


def thread_stacks() -> str:
    """Every other thread's stack, by thread name (for hang reports)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{stack}")
    return "\n".join(parts)


def call_bounded(fn: Callable[[], object], timeout_s: float) -> tuple[bool, object, BaseException | None]:
    """Run fn in a daemon thread; (finished, result, exception). A hang leaves the thread behind."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=target, name="bounded-call", daemon=True)
    t.start()
    t.join(timeout_s)
    exc = box.get("exc")
    return not t.is_alive(), box.get("result"), exc if isinstance(exc, BaseException) else None


@dataclass
class StressReport:
    ops: int = 0
    erases: int = 0
    hung: bool = False
    hang_after_s: float = 0.0
    last_op_s: float = 0.0  # when the last operation completed, from the start of the run
    stacks: str = ""
    errors: list[str] = field(default_factory=list)  # unexpected exceptions (the first 50, with tracebacks)
    error_kinds: Counter[str] = field(default_factory=Counter)  # every exception, by type and message
    mismatches: list[str] = field(default_factory=list)  # wrong bytes returned by a load


def run_stress(store: Store, seconds: float, watchdog_s: float, n_workers: int = 4) -> StressReport:
    """Workers put and load the STRESS_SEQUENCES of users u0..u3 while an eraser erases a random
    user every 0.3-1 s. Never blocks for more than ~seconds + watchdog_s: all work runs in daemon
    threads, and a stretch of `watchdog_s` without any completed operation is reported as a hang.

    What a load may return: user u's generation g starts when the eraser's erase_user(u) returns
    (puts and erases of one user are serialized by a per-user lock, so a put of generation g
    always completes before the erase that ends g begins). A load that reads generation g0 before
    it starts and g1 after it returns must return, page by page, the bytes of some generation in
    [g0, g1]: never bytes of an erased generation, never another user's bytes, never garbage.
    """
    fid = store.fingerprints.register(SMALL_FP)
    report = StressReport()
    state_lock = threading.Lock()
    user_locks = [threading.Lock() for _ in range(STRESS_USERS)]
    gen = [0] * STRESS_USERS
    last_progress = [time.monotonic()]
    stop = threading.Event()
    expected: dict[tuple[int, int, int], list[bytes]] = {}

    def pages(u: int, g: int, s: int) -> list[bytes]:
        key = (u, g, s)
        with state_lock:
            got = expected.get(key)
        if got is None:
            got = pages_for(SMALL_FP, STRESS_SEQUENCES[s], salt=stress_salt(u, g))
            with state_lock:
                expected[key] = got
        return got

    def done(kind: str) -> None:
        with state_lock:
            report.ops += 1
            report.erases += kind == "erase"
            last_progress[0] = time.monotonic()

    def failed(what: str) -> None:
        exc = sys.exc_info()[1]
        kind = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        with state_lock:
            report.error_kinds[kind] += 1
            if len(report.errors) < 50:
                report.errors.append(f"{what}: {traceback.format_exc()}")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            u, s = rng.randrange(STRESS_USERS), rng.randrange(len(STRESS_SEQUENCES))
            tokens = STRESS_SEQUENCES[s]
            try:
                tenant = store.identity.tenant_for(f"u{u}")
                if rng.random() < 0.5:
                    with user_locks[u]:
                        put_sequence(store, fid, tenant, tokens, pages(u, gen[u], s))
                else:
                    g0 = gen[u]
                    n, got = load_sequence(store, fid, tenant, tokens)
                    g1 = gen[u]
                    if n != len(got) * _BS:
                        raise AssertionError(f"load_sequence said {n} tokens for {len(got)} pages")
                    for i, page in enumerate(got):
                        if not any(page == pages(u, g, s)[i] for g in range(g0, g1 + 1)):
                            olds = [g for g in range(g0) if page == pages(u, g, s)[i]]
                            with state_lock:
                                report.mismatches.append(
                                    f"u{u} seq {s} page {i}: generations {g0}..{g1} allowed, got "
                                    + (f"erased generation {olds}" if olds else "bytes of no generation")
                                )
                            break
                done("op")
            except Exception:
                failed(f"worker {seed}")

    def eraser() -> None:
        rng = random.Random(12345)
        while not stop.wait(rng.uniform(0.3, 1.0)):
            u = rng.randrange(STRESS_USERS)
            try:
                with user_locks[u]:
                    store.eraser.erase_user(f"u{u}")
                    gen[u] += 1
                done("erase")
            except Exception:
                failed("eraser")

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"stress-{i}", daemon=True) for i in range(n_workers)
    ]
    threads.append(threading.Thread(target=eraser, name="stress-eraser", daemon=True))
    start = time.monotonic()
    for t in threads:
        t.start()
    while time.monotonic() - start < seconds:
        time.sleep(0.1)
        with state_lock:
            idle = time.monotonic() - last_progress[0]
        if idle > watchdog_s:
            report.hung, report.hang_after_s = True, time.monotonic() - start
            break
    stop.set()
    deadline = time.monotonic() + (0 if report.hung else watchdog_s)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if not report.hung and any(t.is_alive() for t in threads):
        report.hung, report.hang_after_s = True, time.monotonic() - start
    report.last_op_s = last_progress[0] - start
    if report.hung:
        report.stacks = thread_stacks()
    return report


def exit_hard_at_shutdown(status: int = 1) -> None:
    """After a detected deadlock: end the process at interpreter shutdown instead of hanging.

    A deadlocked store leaves its loader pool's (non-daemon) threads blocked on a lock, and
    interpreter shutdown joins them forever. Callbacks of threading's private `_register_atexit`
    run in reverse order, so this one runs before concurrent.futures joins its workers.
    """

    def bail() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    threading._register_atexit(bail)  # type: ignore[attr-defined]


def seed_one_version(engine: Engine) -> None:
    """alice's session `trip` with one version of tokens [1, 2], written as raw rows (the columns
    every migration since 0003 has), for tests that upgrade a database with data in it."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sessions (user_id, id, version_count) VALUES ('alice', 'trip', 1)"))
        conn.execute(
            text(
                "INSERT INTO branches (user_id, session_id, name, head_version)"
                " VALUES ('alice', 'trip', 'main', 1)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO versions (user_id, session_id, number, branch, n_tokens, tokens, messages,"
                " messages_base, n_messages, digest, body_bytes) VALUES ('alice', 'trip', 1, 'main', 2,"
                " :t, '[]', 0, 0, 'd', 8)"
            ),
            {"t": b"\x01\0\0\0\x02\0\0\0"},
        )
