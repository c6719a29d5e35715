"""The `store_meta` key-value table: small settings of a data directory (key verifier, wrapped
server secret, registered model fingerprints). Each call is its own short transaction."""

from __future__ import annotations

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
