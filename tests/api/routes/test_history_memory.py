"""A request's memory follows the request, not the user's whole history (issue 19, item 13).

Deleting one session read every version body of every session of its user (to find the pages
other sessions still use); `GET /v1/sessions` read each listed session's version bodies, messages
included, to count its `stored_bytes`; `GET /v1/sessions/{id}/versions` read every version with
its body and had no pagination. Peaks are measured with tracemalloc (numpy's buffers and the
driver's bytes are traced), against histories many times larger than the bound.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from dss.store import Store
from tests.api.test_unit import DEV, as_user, settings_for, started, state_of
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

T = TypeVar("T")
BS = SMALL_FP.block_size
SHARED = np.arange(1, 1 + 2 * BS, dtype=np.int32)  # two pages every session of the user starts with


def peak_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """`fn()` and the peak of traced memory above what was allocated when it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def session_tokens(session: int, version: int, n_tokens: int) -> np.ndarray:
    """The shared pages, then two pages of the session's own, then the version's own tokens."""
    own = np.full(2 * BS, 10_000 + session, dtype=np.int32)
    rest = np.arange(n_tokens - len(SHARED) - len(own), dtype=np.int32) + 100_000 * (version + 1)
    return np.concatenate([SHARED, own, rest])


def fill(store: Store, user: str, sessions: int, versions: int, n_tokens: int) -> None:
    """`sessions` sessions of `versions` versions of `n_tokens` tokens; the KV of each session's
    first four pages (two shared by all, two its own) is stored."""
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for(user)
    for s in range(sessions):
        store.versions.create_session(user, f"s{s}")
        for v in range(versions):
            tokens = session_tokens(s, v, n_tokens)
            store.versions.commit(
                user,
                f"s{s}",
                tokens=tokens,
                messages=[{"role": "user", "content": f"turn {v}"}],
                fingerprint=fid,
            )
        head = session_tokens(s, 0, n_tokens)[: 4 * BS]
        put_sequence(store, fid, tenant, head, pages_for(SMALL_FP, head))


def _deleting_one_session(data_dir: Path, sessions: int) -> int:
    """The peak memory of deleting session s0 of `sessions` sessions x 4 versions x 4096 tokens
    (16 KiB of token ids a version), checking what it dropped and kept."""
    store = open_store(data_dir)
    try:
        fill(store, "alice", sessions=sessions, versions=4, n_tokens=4096)
        fid, tenant = SMALL_FP.id, store.identity.tenant_for("alice")
        doomed, kept = session_tokens(0, 0, 4096), session_tokens(1, 0, 4096)
        assert store.kv.match(fid, tenant, doomed).n_tokens == 4 * BS  # type: ignore[arg-type]
        dropped, peak = peak_bytes(lambda: store.sessions.delete("alice", "s0"))
        assert dropped == 2  # its own two pages; the two shared ones stay (the other sessions use them)
        assert store.kv.match(fid, tenant, doomed).n_tokens == 2 * BS  # type: ignore[arg-type]
        assert store.kv.match(fid, tenant, kept).n_tokens == 4 * BS  # type: ignore[arg-type]
        store.check()
        return peak
    finally:
        store.close()


def test_deleting_a_session_reads_that_session_not_the_users_history(tmp_path: Path) -> None:
    """Deleting one session holds what that session needs, not the user's history: the old code
    held every other session's token ids (and messages) at once, 1.9 MiB with 30 sessions, growing
    with each. Now the peak is the same with 3x the history, and bounded by the session's own
    size: the addresses a save of its tokens can have used (about one per token: every tail
    length after every page, for the remote tier and the other servers), ~40x its token ids."""
    small = _deleting_one_session(tmp_path / "small", sessions=16)
    large = _deleting_one_session(tmp_path / "large", sessions=48)  # 3x the rest of the history
    one_session = 4 * 4096 * 4  # its token ids
    assert large < 1.25 * small + one_session, f"peak {large} B with 3x the history, {small} B before"
    assert large < 64 * one_session, f"peak {large} B while deleting one session of 4 versions"


@pytest.fixture
def big_session(tmp_path: Path) -> Iterator[TestClient]:
    """One session of 40 versions x 16k tokens (64 KiB of token ids each, 2.5 MiB in all)."""
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        fill(state_of(started(c)).store, "alice", sessions=1, versions=40, n_tokens=16_384)
        yield c


ONE_VERSION = 16_384 * 4


def test_listing_sessions_counts_stored_bytes_without_holding_the_history(big_session: TestClient) -> None:
    r, peak = peak_bytes(lambda: big_session.get("/v1/sessions", headers=as_user("alice")))
    assert r.status_code == 200
    assert [s["stored_bytes"] for s in r.json()["data"]] == [4 * SMALL_FP.page_nbytes]  # the same value
    assert peak < 16 * ONE_VERSION, f"peak {peak} B listing one session of 40 versions"
    one, peak = peak_bytes(lambda: big_session.get("/v1/sessions/s0", headers=as_user("alice")))
    assert one.json()["stored_bytes"] == 4 * SMALL_FP.page_nbytes
    assert peak < 16 * ONE_VERSION, f"peak {peak} B reading one session of 40 versions"


def test_listing_versions_holds_one_chunk_at_a_time(big_session: TestClient) -> None:
    r, peak = peak_bytes(lambda: big_session.get("/v1/sessions/s0/versions", headers=as_user("alice")))
    assert r.status_code == 200 and len(r.json()["data"]) == 40
    assert r.json()["data"][0]["resident"]["host"] == 4 * BS
    assert peak < 16 * ONE_VERSION, f"peak {peak} B listing 40 versions"


def test_versions_are_listed_a_page_at_a_time(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data", auth=DEV, limits={"max_list_limit": 3})
    with TestClient(create_app(settings)) as c:
        store = state_of(started(c)).store
        fill(store, "alice", sessions=1, versions=7, n_tokens=64)
        h = as_user("alice")
        pages: list[list[int]] = []
        after: str | None = None
        while True:
            q = f"?after={after}" if after is not None else ""
            page = c.get(f"/v1/sessions/s0/versions{q}", headers=h).json()
            pages.append([v["number"] for v in page["data"]])
            assert page["last_id"] == (str(pages[-1][-1]) if pages[-1] else None)
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == [[1, 2, 3], [4, 5, 6], [7]]  # the default limit is limits.max_list_limit
        two = c.get("/v1/sessions/s0/versions?limit=2&after=5", headers=h).json()
        assert [v["number"] for v in two["data"]] == [6, 7] and two["has_more"] is False
        capped = c.get("/v1/sessions/s0/versions?limit=1000", headers=h).json()
        assert len(capped["data"]) == 3 and capped["has_more"] is True  # lowered to the maximum
        assert c.get("/v1/sessions/s0/versions?after=99", headers=h).json()["data"] == []
        assert c.get("/v1/sessions/s0/versions?limit=0", headers=h).status_code == 400
        assert c.get("/v1/sessions/s0/versions?after=-1", headers=h).status_code == 400
        assert c.get(f"/v1/sessions/s0/versions?after={2**31}", headers=h).status_code == 400
        assert c.get("/v1/sessions/s0/versions", headers=as_user("bob")).status_code == 404
