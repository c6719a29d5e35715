"""Every derivation length-prefixes its fields (`dss.derive`): a user id cannot be chosen to
collide with another user's tenant or subject. A store made under the old (ambiguous) derivation
is upgraded once at open: erasure epochs move to the new subject hashes of the users the store
knows, the old tenants' pages and data keys go (the KV cache is recomputable), old receipts still
verify and are still the user's, and a user erased before the upgrade never sees old data."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

import dss.keys.identity as identity_mod
import dss.namespace as namespace_mod
from dss.db.models import DataKey, ErasureEpoch, PageRow, StoreMeta
from dss.db.store_meta import meta_get
from dss.keys.identity import Identity
from dss.namespace import namespace_id, tenant_for_user
from dss.types import FingerprintId, NamespaceId, TenantId
from dss.wire import SessionTag
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence

SECRET = b"s" * 32


def test_a_user_id_cannot_collide_with_another_users_tenant() -> None:
    assert tenant_for_user(SECRET, "alice", 1) != tenant_for_user(SECRET, "alice\x00epoch\x001", 0)
    assert tenant_for_user(SECRET, "alice", 12) != tenant_for_user(SECRET, "alice\x00epoch\x001", 2)
    assert namespace_id(FingerprintId("ab"), TenantId("c")) != namespace_id(
        FingerprintId("a"), TenantId("bc")
    )
    key = b"k" * 32
    sig = SessionTag(TenantId("t"), "s\x00").to_params(key)["sig"]
    assert sig != SessionTag(TenantId("t\x00s"), "").to_params(key)["sig"]


# ---------------------------------------------------------------- the old derivation, as it was
def _old_tenant(secret: bytes, user: str, epoch: int = 0) -> TenantId:
    msg = b"dss-tenant\x00" + str(user).encode()
    if epoch:
        msg += b"\x00epoch\x00" + str(epoch).encode()
    return TenantId(hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32])


def _old_subject(secret: bytes, user: str) -> str:
    return hashlib.blake2b(b"dss-subject\x00" + user.encode(), key=secret[:32], digest_size=20).hexdigest()


def _old_namespace_id(fingerprint: FingerprintId, tenant: TenantId) -> NamespaceId:
    return NamespaceId(hashlib.blake2b(f"{fingerprint}\x00{tenant}".encode(), digest_size=16).digest())


def _old_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A data directory written by the old derivation: alice chats (pages on disk), bob and carol
    were erased (bob came back and chatted again; carol never came back and has no key)."""
    with monkeypatch.context() as mp:
        mp.setattr(namespace_mod, "tenant_for_user", _old_tenant)
        mp.setattr(identity_mod, "tenant_for_user", _old_tenant)
        mp.setattr(namespace_mod, "namespace_id", _old_namespace_id)
        store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
        secret = store.keys.unwrap(
            bytes.fromhex(meta_get(store.sf, "server_secret_wrapped") or ""), "server-secret"
        )
        mp.setattr(Identity, "subject_hash", lambda _self, user: _old_subject(secret, user))
        fid = store.fingerprints.register(SMALL_FP)
        toks = np.arange(1, 17, dtype=np.int32)
        for user in ("alice", "bob", "carol"):
            store.versions.create_session(user, f"{user}-s")
            put_sequence(store, fid, store.identity.tenant_for(user), toks, pages_for(SMALL_FP, toks))
        bob_receipt = store.eraser.erase_user("bob")
        carol_receipt = store.eraser.erase_user("carol")
        store.versions.create_session("bob", "bob-again")
        put_sequence(store, fid, store.identity.tenant_for("bob"), toks, pages_for(SMALL_FP, toks, salt=1))
        assert store.identity.tenant_for("bob") == _old_tenant(secret, "bob", 1)
        assert store.flush()
        store.close()
    # The old code had no derivation version in store_meta.
    from dss.db.connect import make_engine, make_session_factory, sqlite_url_for

    engine = make_engine(sqlite_url_for(tmp_path / "data"))
    with make_session_factory(engine).begin() as s:
        s.query(StoreMeta).filter(StoreMeta.key.like("derivation%")).delete(synchronize_session=False)
    engine.dispose()
    return {"secret": secret, "fid": fid, "tokens": toks, "bob": bob_receipt, "carol": carol_receipt}


def test_a_store_made_under_the_old_derivation_is_upgraded_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _old_store(tmp_path, monkeypatch)
    secret, toks = old["secret"], old["tokens"]
    assert isinstance(secret, bytes) and isinstance(toks, np.ndarray)
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    assert meta_get(store.sf, "derivation") == "2"
    fid = store.fingerprints.register(SMALL_FP)
    # New tenants, the epochs of known users kept: bob stays at epoch 1.
    assert (
        store.identity.tenant_for("alice")
        == tenant_for_user(secret, "alice", 0)
        != _old_tenant(secret, "alice")
    )
    assert store.identity.tenant_for("bob") == tenant_for_user(secret, "bob", 1)
    with store.sf() as s:
        assert s.get(ErasureEpoch, store.identity.subject_hash("bob")).epoch == 1  # type: ignore[union-attr]
        # Nothing of any old tenant is left: page rows and data keys gone, files removed.
        assert s.scalar(select(func.count()).select_from(PageRow)) == 0
        tenants = set(s.execute(select(DataKey.tenant)).scalars())
    assert not tenants & {_old_tenant(secret, u, e) for u in ("alice", "bob", "carol") for e in (0, 1)}
    assert store.disk is not None and list(store.disk.scan()) == []
    # bob, erased before the upgrade, and everyone else: cold, whatever the tenant asked for.
    for user in ("alice", "bob", "carol"):
        assert load_sequence(store, fid, store.identity.tenant_for(user), toks)[0] == 0
        for e in (0, 1):
            assert load_sequence(store, fid, _old_tenant(secret, user, e), toks)[0] == 0
    # Old receipts still verify, and are still their user's.
    for name in ("bob", "carol"):
        receipt = old[name]
        v = store.eraser.verify(receipt.id)  # type: ignore[attr-defined]
        assert v.remnants == 0 and v.chain_ok, v.details
        assert receipt.subject in store.identity.receipt_subjects(name)  # type: ignore[attr-defined]
    # The upgraded store works: alice saves and loads under her new tenant, erasures still chain.
    alice = store.identity.tenant_for("alice")
    assert put_sequence(store, fid, alice, toks, pages_for(SMALL_FP, toks)) == 4
    receipt = store.eraser.erase_user("bob")
    assert store.identity.tenant_for("bob") == tenant_for_user(secret, "bob", 2)
    assert store.eraser.verify(receipt.id).remnants == 0
    store.check()
    store.close()
    # Once: a second open changes nothing.
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    assert store.recovery_report is not None and store.recovery_report.pages_indexed == 4
    assert load_sequence(store, fid, alice, toks)[0] == 16
    assert store.identity.tenant_for("bob") == tenant_for_user(secret, "bob", 2)
    store.close()
