"""The key caches are bounded (issue 28): user ids are chosen by frontends, so the cache of
erasure epochs (`Identity`) and the cache of unwrapped data keys (`Keyring`) must not grow with
them; and what was dropped is read again from the database, never served stale (an erased user's
old tenant must not come back when its cache entry is evicted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dss.errors import KeyDestroyed, UserErased
from dss.keys.bounded import BoundedLru
from dss.types import UserId
from tests.store_helpers import open_store

BOUND = 8


def test_a_bounded_lru_drops_the_least_recently_used() -> None:
    lru: BoundedLru[str, int] = BoundedLru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # "b" is now the least recently used
    lru.put("c", 3)
    assert len(lru) == 2 and "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    assert lru.evictions == 1
    with pytest.raises(ValueError):
        BoundedLru(0)


def test_many_distinct_users_keep_both_caches_at_their_bound(tmp_path: Path) -> None:
    store = open_store(tmp_path, identity_cache_entries=BOUND, data_key_cache_entries=BOUND)
    try:
        for i in range(200):
            tenant = store.identity.tenant_for(UserId(f"end-user-{i}"))
            store.keyring.data_key(tenant)
        assert store.identity.cached_epochs() == BOUND
        assert store.keyring.cached_keys() == BOUND
    finally:
        store.close()


def test_an_evicted_data_key_is_unwrapped_again_to_the_same_key(tmp_path: Path) -> None:
    store = open_store(tmp_path, identity_cache_entries=BOUND, data_key_cache_entries=BOUND)
    try:
        tenant = store.identity.tenant_for(UserId("alice"))
        key = store.keyring.data_key(tenant)
        for i in range(3 * BOUND):  # alice's key is evicted
            store.keyring.data_key(store.identity.tenant_for(UserId(f"other-{i}")))
        assert store.keyring.cached_keys() == BOUND
        assert store.keyring.data_key(tenant) == key
    finally:
        store.close()


def test_an_erased_users_evicted_entries_do_not_resurrect_the_old_tenant(tmp_path: Path) -> None:
    store = open_store(tmp_path, identity_cache_entries=BOUND, data_key_cache_entries=BOUND)
    alice = UserId("alice")
    try:
        admitted = store.identity.epoch_of(alice)
        old = store.identity.tenant_for(alice)
        store.keyring.data_key(old)
        store.versions.create_session(alice, epoch=admitted)
        store.eraser.erase_user(alice)
        for i in range(3 * BOUND):  # every entry of alice is evicted (and re-read in between)
            store.identity.tenant_for(alice)
            store.keyring.data_key(store.identity.tenant_for(UserId(f"other-{i}")))
        new = store.identity.tenant_for(alice)
        assert new != old and store.identity.epoch_of(alice) == admitted + 1
        with pytest.raises(KeyDestroyed):  # the retired tenant gets no key again
            store.keyring.data_key(old)
        # The write fence reads the epoch row, not the cache: a request admitted before the
        # erasure is refused, whatever was evicted meanwhile.
        with pytest.raises(UserErased):
            store.versions.create_session(alice, epoch=admitted)
        assert store.identity.cached_epochs() <= BOUND and store.keyring.cached_keys() <= BOUND
    finally:
        store.close()
