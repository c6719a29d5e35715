"""Two servers opening one new store at once (a fleet started together against a fresh
database) must end up with the store's one server secret and master-key verifier: tenants derived
from two secrets would split every user in two (another server cannot read their pages, and an
erasure on one server leaves the other's tenant, and its cached KV, untouched)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.db.store_meta import meta_get
from dss.errors import WrongMasterKey
from dss.keys import identity as identity_module
from dss.keys.crypto import KeyManager
from dss.keys.identity import SERVER_SECRET_META, Identity, load_master_key
from dss.types import UserId


def test_two_servers_opening_a_new_store_at_once_share_its_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        sf = make_session_factory(engine)
        keys = KeyManager(os.urandom(32), "test")
        first = Identity.load(sf, keys)
        # The second server read the store before the first one wrote its secret.
        real = identity_module.meta_get
        monkeypatch.setattr(
            identity_module, "meta_get", lambda s, k: None if k == SERVER_SECRET_META else real(s, k)
        )
        second = Identity.load(sf, keys)
        monkeypatch.undo()
        alice = UserId("alice")
        assert first.tenant_for(alice) == second.tenant_for(alice)
        assert Identity.load(sf, keys).tenant_for(alice) == first.tenant_for(alice)
        assert meta_get(sf, SERVER_SECRET_META) is not None
    finally:
        engine.dispose()


def test_a_second_server_with_another_master_key_is_refused_even_when_it_raced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        sf = make_session_factory(engine)
        monkeypatch.setenv("DSS_MASTER_KEY", os.urandom(32).hex())
        load_master_key(sf, tmp_path / "unused.key", create_if_missing=False)
        real = identity_module.meta_get
        monkeypatch.setattr(identity_module, "meta_get", lambda s, k: None if "verifier" in k else real(s, k))
        monkeypatch.setenv("DSS_MASTER_KEY", os.urandom(32).hex())
        with pytest.raises(WrongMasterKey):
            load_master_key(sf, tmp_path / "unused.key", create_if_missing=False)
    finally:
        engine.dispose()
