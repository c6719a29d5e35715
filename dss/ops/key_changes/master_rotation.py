"""Master-key rotation (`dss keys rotate-master`): every data key, the server secret and the
master-key verifier are re-wrapped under a new master key in one transaction, then the old key
is overwritten. Afterwards the old master opens nothing of the live store (`WrongMasterKey`),
and a database backup taken before the rotation is readable only with the old master: once that
is gone, the backup's wrapped data keys (an erased tenant's among them) are useless.

Offline only. A running server holds the unwrapped master key in memory and would wrap new data
keys under the old one, which no restart could unwrap: so rotation takes this data directory's
owner lock (`DataDirInUse` while a server owns it) and, on PostgreSQL, refuses while any server
of the fleet was seen within `FleetConfig.alive_s`, checked again inside the rotation's
transaction after it locked the verifier's row. That lock closes the window between the check
and the commit: a server starting meanwhile registers, then waits for the row to read the
verifier (and, with the old key, fails with `WrongMasterKey`); a running server that was not
seen (a long pause) waits for it before it inserts a new data key, then refuses with
`MasterKeyRotated` (`check_master_in`). Stop every server, rotate once, give every server the
new key, start them.

Crash safety. In place (the key file stays where it is): the new key is first written, durable,
to a pending file next to the old one (`crypto.pending_key_path`); the transaction commits; the
old file's bytes are overwritten with the new key and the pending file goes. Killed before the
commit: the old key still opens the store and the next rotation discards the pending file.
Killed after it: `load_master_key` finds that the old key fails the verifier and the pending key
passes, and finishes the rotation. To another file (`new_key_file`, required when the key comes
from the environment): that file is written, durable, before the commit, and the old key file
(if the key came from one) is overwritten with zeros and unlinked after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from dss.config import StoreConfig
from dss.db.connect import make_engine, make_session_factory, transaction, upgrade_to_head
from dss.db.store_meta import meta_put_in, meta_value_in
from dss.errors import DataDirInUse, WrongMasterKey
from dss.files import try_lock_exclusive
from dss.fleet.members import servers_alive_in
from dss.keys.crypto import (
    DEFAULT_ENV_VAR,
    KeyManager,
    destroy_key_file,
    install_pending_key,
    new_key_file,
    pending_key_path,
)
from dss.keys.identity import MASTER_VERIFIER_META, SERVER_SECRET_AAD, SERVER_SECRET_META, load_master_key
from dss.keys.keyring import rewrap_data_keys_in

log = logging.getLogger("dss.keys")  # the logger operators know rotation by


@dataclass(frozen=True, slots=True)
class RotationReport:
    data_keys: int  # data keys re-wrapped
    key_file: Path  # where the new master key is
    removed_key_file: Path | None  # the old key file, overwritten and unlinked (rotation to another file)


def rotate_master(config: StoreConfig, new_key_file: Path | None = None) -> RotationReport:
    """Rotate the master key of the store `config` names; `new_key_file`: write the new key
    there (a new file) instead of over the current key file."""
    config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = try_lock_exclusive(config.owner_lock_path)
    if lock is None:
        raise DataDirInUse(
            f"another process owns the data directory {config.data_dir}: stop that server first "
            "(the master key rotates offline)"
        )
    try:
        url = config.resolved_db_url
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            sf = make_session_factory(engine)
            alive_s = config.fleet.alive_s
            if engine.dialect.name == "postgresql":  # early, before a new key file is written
                with sf() as s:
                    _refuse_if_alive(servers_alive_in(s, alive_s), alive_s)
            current = load_master_key(sf, config.resolved_key_file, create_if_missing=False)
            report = _rotate(sf, current, new_key_file, alive_s)
            if engine.dialect.name == "sqlite":
                # The old wrapped values must not wait in the WAL for the next checkpoint.
                with engine.connect() as conn:
                    conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
        finally:
            engine.dispose()
    finally:
        lock.close()
    log.warning("rotated the master key: %s", report)
    return report


def rewrap_all(
    sf: sessionmaker[Session], old: KeyManager, new: KeyManager, alive_s: float | None = None
) -> int:
    """One transaction: every data key, the server secret and the verifier under `new`.

    The verifier's row is locked first (`FOR UPDATE`) and held to the commit: a server starting
    meanwhile waits to read it (`load_master_key`), and a running one waits to insert a new data
    key (`check_master_in`) and then refuses. `alive_s` (PostgreSQL): after that lock, refuse
    (`DataDirInUse`) when a server of the fleet was seen within it; a server registers before it
    reads the verifier, so none can slip between this check and the commit."""
    with transaction(sf) as s:
        verifier = meta_value_in(s, MASTER_VERIFIER_META, lock="update")
        if verifier is None:
            raise WrongMasterKey("this store has no master-key verifier yet: open it once first")
        if alive_s is not None and s.get_bind().dialect.name == "postgresql":
            _refuse_if_alive(servers_alive_in(s, alive_s), alive_s)
        old.check_verifier(bytes.fromhex(verifier))
        n = rewrap_data_keys_in(s, old, new)
        secret = meta_value_in(s, SERVER_SECRET_META)
        if secret is not None:
            plain = old.unwrap(bytes.fromhex(secret), SERVER_SECRET_AAD)
            meta_put_in(s, SERVER_SECRET_META, new.wrap(plain, SERVER_SECRET_AAD).hex())
        meta_put_in(s, MASTER_VERIFIER_META, new.make_verifier().hex())
    return n


def _rotate(
    sf: sessionmaker[Session], current: KeyManager, new_file: Path | None, alive_s: float
) -> RotationReport:
    if new_file is None:
        if current.file is None:
            raise WrongMasterKey(
                f"the master key comes from env {DEFAULT_ENV_VAR}: give --new-key-file PATH to write "
                f"the new key to (then set {DEFAULT_ENV_VAR} to it, or point master_key_file there)"
            )
        target = current.file
        pending = pending_key_path(target)
        # Left by a rotation killed before its commit (one killed after it was finished when
        # `load_master_key` opened the store just now): its key never wrapped anything.
        pending.unlink(missing_ok=True)
        new = KeyManager(new_key_file(pending), str(target), file=target)
        n = rewrap_all(sf, current, new, alive_s)
        install_pending_key(target)
        return RotationReport(n, target, None)
    new = KeyManager(new_key_file(new_file), str(new_file), file=new_file)
    n = rewrap_all(sf, current, new, alive_s)
    removed = None
    if current.file is not None and current.file.resolve() != new_file.resolve():
        try:
            destroy_key_file(current.file)
            removed = current.file
        except OSError as exc:  # committed already: the old key opens nothing now, but say so
            log.warning("could not remove the old master key file %s (%s): delete it", current.file, exc)
    return RotationReport(n, new_file, removed)


def _refuse_if_alive(alive: list[str], alive_s: float) -> None:
    if alive:
        raise DataDirInUse(
            f"servers of this database were seen in the last {alive_s:g} s "
            f"({', '.join(alive)}): stop every server first (the master key rotates offline)"
        )
