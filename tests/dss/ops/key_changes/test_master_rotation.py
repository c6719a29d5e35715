"""Master-key rotation (`dss keys rotate-master`): every data key, the server secret and the
verifier are re-wrapped under a new master key in one transaction; the old key file is
overwritten; opening with the old key fails. With a database backup taken before the rotation
and an erasure after it, the new master cannot unwrap the backup's key of the erased tenant; the
old master still can (what a backup plus the old master reveal: see docs/privacy.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, select, text
from typer.testing import CliRunner

from dss.config import StoreConfig
from dss.db.connect import SQLITE_FILENAME
from dss.db.models import DataKey
from dss.errors import DataDirInUse, WrongMasterKey
from dss.keys.crypto import KeyManager
from dss.ops.key_changes import master_rotation as rotation
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence

TOKS = np.arange(1, 17, dtype=np.int32)


def _cfg(tmp_path: Path) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path / "data", fsync=False, shm_dir=tmp_path / "shm")


def _wrapped_keys(db_file: Path) -> dict[str, bytes]:
    engine = create_engine(f"sqlite:///{db_file}")
    with engine.connect() as conn:
        out = {t: bytes(w) for t, w in conn.execute(select(DataKey.tenant, DataKey.wrapped))}
    engine.dispose()
    return out


def test_rotation_rewraps_everything_and_the_old_master_no_longer_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    data = tmp_path / "data"
    store = open_store(data, shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    put_sequence(store, fid, alice, TOKS, pages_for(SMALL_FP, TOKS))
    put_sequence(store, fid, bob, TOKS, pages_for(SMALL_FP, TOKS, salt=7))
    assert store.flush()
    store.close()
    old_key_text = (data / "master.key").read_text()
    backup = tmp_path / "backup.sqlite3"
    shutil.copy(data / SQLITE_FILENAME, backup)  # a database backup taken BEFORE the rotation

    report = rotation.rotate_master(_cfg(tmp_path))
    assert report.data_keys == len(_wrapped_keys(backup)) >= 2
    new_key_text = (data / "master.key").read_text()
    assert new_key_text != old_key_text and not list(data.glob("*.rotating*"))
    old = KeyManager(bytes.fromhex(old_key_text.strip()), "old master")
    new = KeyManager(bytes.fromhex(new_key_text.strip()), "new master")

    store = open_store(data, shm_dir=tmp_path / "shm")  # the new key file opens it; pages still load
    assert load_sequence(store, fid, alice, TOKS) == (16, pages_for(SMALL_FP, TOKS))
    receipt = store.eraser.erase_user("bob")  # an erasure AFTER the rotation
    assert store.eraser.verify(receipt.id).remnants == 0
    store.close()

    # The old master no longer opens the store.
    monkeypatch.setenv("DSS_MASTER_KEY", old_key_text.strip())
    with pytest.raises(WrongMasterKey):
        open_store(data, shm_dir=tmp_path / "shm")
    monkeypatch.delenv("DSS_MASTER_KEY")

    # The backup's wrapped key of the erased tenant: not under the new master...
    backup_keys = _wrapped_keys(backup)
    with pytest.raises(WrongMasterKey):
        new.unwrap(backup_keys[bob], bob)
    # ...only under the old one, whose file is overwritten: backup + old master = the key.
    assert len(old.unwrap(backup_keys[bob], bob)) == 32
    assert bob not in _wrapped_keys(data / SQLITE_FILENAME)


def test_rotation_is_refused_while_a_server_owns_the_data_dir(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    before = (tmp_path / "data" / "master.key").read_text()
    with pytest.raises(DataDirInUse):
        rotation.rotate_master(_cfg(tmp_path))
    assert (tmp_path / "data" / "master.key").read_text() == before
    store.close()


def test_a_rotation_interrupted_after_its_commit_is_finished_at_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    put_sequence(store, fid, alice, TOKS, pages_for(SMALL_FP, TOKS))
    assert store.flush()
    store.close()

    def crash(*_a: object) -> None:
        raise KeyboardInterrupt("killed after the commit")

    with monkeypatch.context() as mp:
        mp.setattr(rotation, "install_pending_key", crash)
        with pytest.raises(KeyboardInterrupt):
            rotation.rotate_master(_cfg(tmp_path))
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    assert load_sequence(store, fid, alice, TOKS)[0] == 16
    store.close()
    assert not list((tmp_path / "data").glob("*.rotating*"))


def test_a_rotation_to_another_file_and_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    open_store(tmp_path / "data", shm_dir=tmp_path / "shm").close()
    outside = tmp_path / "secrets" / "dss-master.key"
    rotation.rotate_master(_cfg(tmp_path), new_key_file=outside)
    assert not (tmp_path / "data" / "master.key").exists()  # the old key is not left behind
    with pytest.raises(WrongMasterKey):  # nothing silently makes a new key for a store with data
        open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    open_store(tmp_path / "data", shm_dir=tmp_path / "shm", master_key_file=outside).close()
    # From the environment: a file to write the new key to is required.
    monkeypatch.setenv("DSS_MASTER_KEY", outside.read_text().strip())
    with pytest.raises(WrongMasterKey, match="--new-key-file"):
        rotation.rotate_master(_cfg(tmp_path))
    third = tmp_path / "secrets" / "third.key"
    rotation.rotate_master(_cfg(tmp_path), new_key_file=third)
    with pytest.raises(WrongMasterKey):
        open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    monkeypatch.setenv("DSS_MASTER_KEY", third.read_text().strip())
    open_store(tmp_path / "data", shm_dir=tmp_path / "shm").close()


def test_cli_rotate_master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.cli import main

    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    open_store(tmp_path / "data", shm_dir=tmp_path / "shm").close()
    before = (tmp_path / "data" / "master.key").read_text()
    result = CliRunner().invoke(main, ["keys", "rotate-master", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert "re-wrapped" in result.output and before.strip() not in result.output
    assert (tmp_path / "data" / "master.key").read_text() != before
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    held = CliRunner().invoke(main, ["keys", "rotate-master", "--data-dir", str(tmp_path / "data")])
    assert held.exit_code != 0 and "owns the data directory" in held.output
    store.close()


def test_a_master_key_inside_the_data_dir_is_warned_about_outside_dev_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.app import master_key_warning
    from api.settings import load_settings

    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    inside = load_settings(store={"data_dir": tmp_path / "data"})
    assert master_key_warning(inside) is not None and "master.key" in (master_key_warning(inside) or "")
    dev = load_settings(store={"data_dir": tmp_path / "data"}, auth={"dev_mode": True})
    assert master_key_warning(dev) is None
    outside = load_settings(store={"data_dir": tmp_path / "data", "master_key_file": tmp_path / "k"})
    assert master_key_warning(outside) is None
    monkeypatch.setenv("DSS_MASTER_KEY", "00" * 32)
    assert master_key_warning(inside) is None


@pytest.mark.pg
def test_rotation_is_refused_while_a_server_of_the_fleet_is_alive(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server of the database holds the old master in memory: its data dir's lock is
    elsewhere, so the `servers` heartbeats decide."""
    monkeypatch.delenv("DSS_MASTER_KEY", raising=False)
    key_file = tmp_path / "fleet.key"
    other = open_store(tmp_path / "other", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=key_file)
    cfg = StoreConfig(data_dir=tmp_path / "mine", db_url=pg_url, master_key_file=key_file, fsync=False)
    with pytest.raises(DataDirInUse, match="stop every server"):
        rotation.rotate_master(cfg)
    other.close()
    with other.db.begin() as conn:  # as if it stopped long ago
        conn.execute(text("UPDATE servers SET last_seen = now() - interval '1 hour'"))
        wrapped = conn.execute(text("SELECT count(*) FROM data_keys")).scalar_one()
    assert rotation.rotate_master(cfg).data_keys == wrapped  # every data key re-wrapped
    with pytest.raises(WrongMasterKey):
        open_store(
            tmp_path / "other", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=tmp_path / "x.key"
        )
    open_store(tmp_path / "other", shm_dir=tmp_path / "shm", db_url=pg_url, master_key_file=key_file).close()
