"""A turn's KV is prefetched from the shared tier as soon as its target is resolved
(`api.turn.respond.prefetch_kv`, issue 30): the version the turn extends, under the tenant the turn
was admitted with; nothing for a turn without a stored base, one that keeps nothing, or a store
without a remote tier."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from api.turn.respond import prefetch_kv


class _Loads:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def prefetch(self, fid: Any, tenant: Any, tokens: Any) -> bool:
        self.calls.append((fid, tenant, tokens))
        return True


def _state(remote: object | None) -> tuple[Any, _Loads]:
    loads = _Loads()
    store = SimpleNamespace(remote=remote, kv=SimpleNamespace(loads=loads))
    return SimpleNamespace(store=store), loads


def _turn(base: object | None, persist: bool = True) -> Any:
    target = SimpleNamespace(base=base) if base is not None else None
    return SimpleNamespace(target=target, persist=persist, admitted=SimpleNamespace(tenant="t-1"))


def test_the_base_version_is_prefetched_under_the_admitted_tenant() -> None:
    tokens = np.arange(10, dtype=np.int32)
    base = SimpleNamespace(fingerprint="fp-1", n_tokens=10, tokens=tokens)
    state, loads = _state(remote=object())
    assert prefetch_kv(state, _turn(base))
    assert loads.calls == [("fp-1", "t-1", tokens)]


def test_nothing_is_prefetched_without_a_base_a_remote_tier_or_persistence() -> None:
    base = SimpleNamespace(fingerprint="fp-1", n_tokens=10, tokens=np.arange(10, dtype=np.int32))
    empty = SimpleNamespace(fingerprint="fp-1", n_tokens=0, tokens=np.zeros(0, dtype=np.int32))
    for state_remote, turn in (
        (object(), _turn(None)),
        (None, _turn(base)),
        (object(), _turn(base, persist=False)),
        (object(), _turn(empty)),
    ):
        state, loads = _state(state_remote)
        assert not prefetch_kv(state, turn)
        assert loads.calls == []
