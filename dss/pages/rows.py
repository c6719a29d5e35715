"""The `pages` table: one durable row per page on the disk tier (the index is rebuilt from them).

Rows are per server (`server`, this store's `Store.server_id`): servers that share one database
each have their own disk tier, so `add`, `delete` and `all` touch this server's rows only. The
functions below the class touch every server's rows, in the caller's transaction: an erasure
(`delete_tenants_in`, by tenant), a session's deletion reaching the fleet (`delete_pages_in`,
`dss.fleet.page_drops`), the tenant-derivation upgrade (`delete_all_in`), and an erasure's
verification (`count_tenant_in`). This module is the `pages` table's one owner
(`dss.db.models.TABLE_OWNERS`).

A row holds the page's token ids sealed (AES-GCM) under its tenant's data key, never in the
clear: they are user content (a sessionless chat's prompt) and a database backup must not show
them. Recovery opens them with the keyring (`all(key_of)`); a row whose key is gone (an erased
tenant) or that does not open under it is unusable and goes, like a row without its file. The
associated data names the tenant and the page, so a sealed value moved to another row does not
open. The public tenant has a data key like any other, so public pages are sealed the same way.

A row is written after its page file is durable and deleted before the file is unlinked, so a
crash leaves at worst a file without a row (an orphan that recovery removes), never a row that
names bytes we cannot read. For the same reason a row's insert need not be fsynced (a power loss
that undoes it leaves an orphan too). No lock here: each call is its own short transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from sqlalchemy import CursorResult, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import PageRow
from dss.derive import encode_fields
from dss.errors import CorruptPage
from dss.keys import crypto
from dss.pages.meta import PageMeta
from dss.tokens import TOKEN_DTYPE, as_tokens
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_CHUNK = 500

KeyOf = Callable[[TenantId], bytes | None]
"""A tenant's data key, or None when it has none (erased, never created): its rows are unusable."""


def _tokens_aad(tenant: TenantId, page: PageHash) -> bytes:
    return encode_fields("dss/page-tokens/v1", tenant, page)


def seal_tokens(meta: PageMeta, data_key: bytes) -> bytes:
    return crypto.encrypt(data_key, as_tokens(meta.tokens).tobytes(), _tokens_aad(meta.tenant, meta.hash))


def open_tokens(sealed: bytes, tenant: TenantId, page: PageHash, data_key: bytes | AESGCM) -> np.ndarray:
    """Raises `CorruptPage` when the value does not open under the key (moved, damaged, wrong key)."""
    plain = crypto.decrypt(data_key, sealed, _tokens_aad(tenant, page))
    if len(plain) % TOKEN_DTYPE.itemsize:
        raise CorruptPage("sealed page tokens have a partial token id")
    return np.frombuffer(plain, dtype=TOKEN_DTYPE).copy()


class PageRows:
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        codec: str,
        server: str,
        add_factory: sessionmaker[Session] | None = None,
    ) -> None:
        self._sf = session_factory
        self._codec = codec
        self.server = server
        # `add` may commit without an fsync (`make_engine(durable_commits=False)`): a lost row
        # leaves an orphan file, which recovery removes. Deletes stay durable: a row that
        # outlived its file would name bytes we cannot read.
        self._add_sf = add_factory if add_factory is not None else session_factory

    def add(self, meta: PageMeta, disk_bytes: int, data_key: bytes) -> None:
        """`data_key`: the tenant's, which the page file was just encrypted under."""
        row = PageRow(
            server=self.server,
            hash=meta.hash,
            namespace=meta.namespace,
            tenant=meta.tenant,
            fingerprint=meta.fingerprint,
            parent=meta.parent,
            page_index=meta.index,
            n_tokens=meta.n_tokens,
            sealed_tokens=seal_tokens(meta, data_key),
            nbytes=meta.nbytes,
            disk_bytes=disk_bytes,
            codec=self._codec,
            checksum=meta.checksum or b"",
        )
        try:
            with transaction(self._add_sf) as s:
                if s.get(PageRow, (self.server, meta.hash)) is None:
                    s.add(row)
        except IntegrityError:
            pass  # written meanwhile by a previous owner's recovery path: the same page

    def delete(self, pages: Iterable[PageHash]) -> None:
        items = list(pages)
        if not items:
            return
        with transaction(self._sf) as s:
            for i in range(0, len(items), _CHUNK):
                s.execute(
                    delete(PageRow).where(
                        PageRow.server == self.server, PageRow.hash.in_(items[i : i + _CHUNK])
                    )
                )

    def all(self, key_of: KeyOf) -> tuple[list[tuple[PageMeta, int]], list[PageHash]]:
        """This server's rows, for recovery: (page metadata, bytes on disk) of the rows whose
        tokens open under their tenant's key (`key_of`), and the hashes of those that do not."""
        with self._sf() as s:
            rows = list(s.execute(select(PageRow).where(PageRow.server == self.server)).scalars())
        ok: list[tuple[PageMeta, int]] = []
        unusable: list[PageHash] = []
        ciphers: dict[TenantId, AESGCM | None] = {}
        for r in rows:
            h, tenant = PageHash(bytes(r.hash)), TenantId(r.tenant)
            if tenant not in ciphers:
                key = key_of(tenant)
                ciphers[tenant] = crypto.cipher(key) if key is not None else None
            aead = ciphers[tenant]
            try:
                if aead is None:
                    raise CorruptPage("no data key")
                tokens = open_tokens(bytes(r.sealed_tokens), tenant, h, aead)
                if len(tokens) != r.n_tokens:
                    raise CorruptPage("sealed page tokens do not match the row's count")
            except CorruptPage:
                unusable.append(h)
                continue
            ok.append((meta_of(r, tokens), int(r.disk_bytes)))
        return ok, unusable

    def adopt_unowned(self, holds: Callable[[PageHash], bool]) -> int:
        """Take the rows written before rows had a server (server '', migration 0006) whose page
        file this server's disk tier `holds` as its own: a store upgraded from one server keeps its
        disk tier, and a new server of the fleet opening first takes nothing (its recovery would
        delete rows it has no file for, and the real owner's files would then be orphans). Runs
        at open, before recovery. Returns how many."""
        with self._sf() as s:
            unowned = [
                PageHash(bytes(h))
                for h in s.execute(select(PageRow.hash).where(PageRow.server == "")).scalars()
            ]
        mine_now = [h for h in unowned if holds(h)]
        n = 0
        for i in range(0, len(mine_now), _CHUNK):
            chunk = mine_now[i : i + _CHUNK]
            with transaction(self._sf) as s:
                mine = select(PageRow.hash).where(PageRow.server == self.server, PageRow.hash.in_(chunk))
                # Rows this server already has under its own name win (cannot happen after a plain
                # upgrade; keeps the key unique if it does).
                s.execute(delete(PageRow).where(PageRow.server == "", PageRow.hash.in_(mine)))
                done = s.execute(
                    update(PageRow)
                    .where(PageRow.server == "", PageRow.hash.in_(chunk))
                    .values(server=self.server)
                )
                n += int(cast(CursorResult[Any], done).rowcount)
        return n


def delete_tenants_in(s: Session, tenants: Iterable[TenantId]) -> int:
    """Every server's rows of `tenants` (an erasure); returns how many."""
    done = s.execute(delete(PageRow).where(PageRow.tenant.in_(list(tenants))))
    return int(cast(CursorResult[Any], done).rowcount)


def delete_pages_in(s: Session, tenant: TenantId, pages: Iterable[PageHash]) -> None:
    """Every server's rows of the tenant's `pages` (a session deleted on one server of a fleet)."""
    hashes = list(pages)
    for i in range(0, len(hashes), _CHUNK):
        s.execute(
            delete(PageRow)
            .where(PageRow.tenant == tenant, PageRow.hash.in_(hashes[i : i + _CHUNK]))
            .execution_options(synchronize_session=False)
        )


def delete_all_in(s: Session) -> int:
    """Every row of every server (the tenant-derivation upgrade: the KV cache starts cold)."""
    return int(cast(CursorResult[Any], s.execute(delete(PageRow))).rowcount)


def count_tenant_in(s: Session, tenant: TenantId, created_by: datetime) -> int:
    """How many rows of `tenant`, on any server, were created by `created_by`."""
    q = select(func.count()).select_from(PageRow)
    return int(s.execute(q.where(PageRow.tenant == tenant, PageRow.created_at <= created_by)).scalar_one())


def meta_of(row: PageRow, tokens: np.ndarray) -> PageMeta:
    return PageMeta(
        hash=PageHash(bytes(row.hash)),
        namespace=NamespaceId(bytes(row.namespace)),
        tenant=TenantId(row.tenant),
        fingerprint=FingerprintId(row.fingerprint),
        parent=PageHash(bytes(row.parent)),
        index=row.page_index,
        nbytes=row.nbytes,
        tokens=tokens,
        checksum=bytes(row.checksum or b""),
    )
