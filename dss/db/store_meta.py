"""The `store_meta` key-value table: small settings of a data directory (key verifier, wrapped
server secret, registered model fingerprints, the tenant derivation). Its one owner
(`dss.db.models.TABLE_OWNERS`), below the parts that keep settings there (`dss.keys`,
`dss.index`). The `meta_*` functions are each their own short transaction; the `*_in` ones work
in the caller's, for a setting that must change with other rows (a master-key rotation)."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import StoreMeta


def meta_get(sf: sessionmaker[Session], key: str) -> str | None:
    with sf() as s:
        row = s.get(StoreMeta, key)
        return row.value if row else None


def meta_set(sf: sessionmaker[Session], key: str, value: str) -> None:
    with transaction(sf) as s:
        row = s.get(StoreMeta, key)
        if row is None:
            s.add(StoreMeta(key=key, value=value))
        else:
            row.value = value


def meta_set_default(sf: sessionmaker[Session], key: str, value: str) -> str:
    """Store `value` under `key` unless a value is stored there already, and return the stored
    one. Two servers opening a new store at once both find a key missing; the first insert wins
    and the other gets the winner's value (an update would overwrite it and leave the two
    servers with different values)."""
    try:
        with transaction(sf) as s:
            row = s.get(StoreMeta, key)
            if row is not None:
                return row.value
            s.add(StoreMeta(key=key, value=value))
        return value
    except IntegrityError:  # inserted meanwhile by another server
        stored = meta_get(sf, key)
        if stored is None:
            raise
        return stored


def meta_with_prefix(sf: sessionmaker[Session], prefix: str) -> dict[str, str]:
    with sf() as s:
        rows = s.execute(select(StoreMeta).where(StoreMeta.key.like(prefix + "%"))).scalars()
        return {r.key: r.value for r in rows}


def meta_value_in(s: Session, key: str, lock: Literal["share", "update"] | None = None) -> str | None:
    """The value under `key` in the caller's transaction; `lock`: on PostgreSQL, its row locked
    `FOR SHARE` or `FOR UPDATE` until that transaction ends (SQLite's write lock serialises)."""
    q = select(StoreMeta.value).where(StoreMeta.key == key)
    if lock is not None and s.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(read=lock == "share")
    value = s.scalar(q)
    return None if value is None else str(value)


def meta_put_in(s: Session, key: str, value: str) -> None:
    """Store `value` under `key` in the caller's transaction (insert or update)."""
    row = s.get(StoreMeta, key)
    if row is None:
        s.add(StoreMeta(key=key, value=value))
    else:
        row.value = value
    s.flush()


def meta_insert_in(s: Session, key: str, value: str) -> None:
    """Insert `key` in the caller's transaction; `IntegrityError` (at once: flushed) when another
    transaction inserted it first. Blocks until that one ends when it has not committed yet."""
    s.add(StoreMeta(key=key, value=value))
    s.flush()
