"""Master-key rotation against servers of a PostgreSQL fleet (issue 28): a server starting while a
rotation's transaction is open waits for it and then finds the new verifier (so one configured
with the old key fails with `WrongMasterKey` instead of wrapping new data keys under it); and a
running server whose master was rotated under it refuses to store a data key wrapped under the
old master (`MasterKeyRotated`) instead of writing one no restart could unwrap."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from sqlalchemy import select, text

from dss.config import StoreConfig
from dss.db.models import DataKey
from dss.errors import MasterKeyRotated, WrongMasterKey
from dss.keys.crypto import KeyManager
from dss.ops.key_changes import master_rotation as rotation
from dss.store import Store
from dss.types import UserId
from tests.store_helpers import open_store

pytestmark = pytest.mark.pg


def _stopped_long_ago(store: Store) -> None:
    with store.db.begin() as conn:
        conn.execute(text("UPDATE servers SET last_seen = now() - interval '1 hour'"))


def test_a_server_starting_during_a_rotation_waits_and_never_uses_the_old_master(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    key_file = tmp_path / "fleet.key"
    first = open_store(tmp_path / "a", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=key_file)
    first.keyring.data_key(first.identity.tenant_for(UserId("alice")))
    first.close()
    _stopped_long_ago(first)
    old_key = tmp_path / "old.key"  # what a server not told of the rotation still has
    shutil.copy(key_file, old_key)

    # The rotation pauses inside its transaction (every data key re-wrapped, not committed yet).
    in_transaction, go_on = threading.Event(), threading.Event()
    real_make_verifier = KeyManager.make_verifier

    def paused(self: KeyManager) -> bytes:
        in_transaction.set()
        assert go_on.wait(30)
        return real_make_verifier(self)

    monkeypatch.setattr(KeyManager, "make_verifier", paused)
    cfg = StoreConfig(data_dir=tmp_path / "rotator", db_url=pg_url, master_key_file=key_file, fsync=False)
    rotated: list[object] = []
    rotator = threading.Thread(target=lambda: rotated.append(rotation.rotate_master(cfg)))
    rotator.start()
    assert in_transaction.wait(30)

    opened: list[object] = []

    def start_server() -> None:
        try:
            opened.append(
                open_store(tmp_path / "b", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=old_key)
            )
        except Exception as exc:
            opened.append(exc)

    server = threading.Thread(target=start_server)
    server.start()
    server.join(2.0)
    waited = server.is_alive()  # was: it read the old verifier and opened with the old master
    go_on.set()
    rotator.join(30)
    server.join(30)
    monkeypatch.undo()
    if isinstance(opened[0], Store):
        opened[0].close()
    assert waited, f"the server did not wait for the rotation: {opened}"
    assert isinstance(opened[0], WrongMasterKey), opened
    assert rotated, "the rotation did not commit"


def test_a_running_server_refuses_to_wrap_under_a_master_rotated_since(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    key_file = tmp_path / "fleet.key"
    store = open_store(tmp_path / "a", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=key_file)
    try:
        alice = store.identity.tenant_for(UserId("alice"))
        alice_key = store.keyring.data_key(alice)
        # A rotation that ran anyway (the server was not seen: a long GC pause, a partition).
        old = KeyManager(bytes.fromhex(key_file.read_text().strip()), "old")
        rotation.rewrap_all(store.sf, old, KeyManager(os.urandom(32), "new"))
        bob = store.identity.tenant_for(UserId("bob"))
        with pytest.raises(MasterKeyRotated, match="rotated"):
            store.keyring.data_key(bob)
        with store.sf() as s:  # nothing wrapped under the old master was written
            assert s.scalar(select(DataKey.tenant).where(DataKey.tenant == bob)) is None
        assert store.keyring.data_key(alice) == alice_key  # keys it holds still serve
    finally:
        store.close()
