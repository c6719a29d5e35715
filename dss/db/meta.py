"""The `store_meta` key-value table: small settings of a data directory (key verifier, wrapped
server secret, registered model fingerprints). Each call is its own short transaction."""

from __future__ import annotations

from sqlalchemy import select
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


def meta_with_prefix(sf: sessionmaker[Session], prefix: str) -> dict[str, str]:
    with sf() as s:
        rows = s.execute(select(StoreMeta).where(StoreMeta.key.like(prefix + "%"))).scalars()
        return {r.key: r.value for r in rows}
