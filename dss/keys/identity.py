"""Who a user is to the store: the master key check, the server secret, and the tenant salt.

The master key comes from `DSS_MASTER_KEY` or the key file; a store that already holds data never
silently gets a fresh one (a verifier in `store_meta` is checked). The server secret is random,
stored wrapped by the master key, and keys the HMACs that turn a user id into a tenant (the cache
namespace) and into the subject hash written in erasure receipts.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from dss.db.meta import meta_get, meta_set
from dss.errors import WrongMasterKey
from dss.keys.crypto import KeyManager
from dss.namespace import tenant_for_user
from dss.rpc import rpc_authkey
from dss.types import TenantId

log = logging.getLogger("dss.keys")

_VERIFIER_KEY = "master_key_verifier"
_SECRET_KEY = "server_secret_wrapped"


def load_master_key(sf: sessionmaker[Session], key_file: Path, create_if_missing: bool) -> KeyManager:
    verifier = meta_get(sf, _VERIFIER_KEY)
    keys = KeyManager.load(key_file, create_if_missing=create_if_missing and verifier is None)
    if keys.generated:
        log.warning(
            "generated a new master key at %s: back it up; without it the disk tier is unreadable", key_file
        )
    if verifier is None:
        meta_set(sf, _VERIFIER_KEY, keys.make_verifier().hex())
        return keys
    try:
        keys.check_verifier(bytes.fromhex(verifier))
    except WrongMasterKey:
        raise
    except Exception as exc:
        raise WrongMasterKey(f"master key from {keys.source} does not open this store") from exc
    return keys


class Identity:
    """Derives tenants and receipt subjects from user ids under the server secret."""

    def __init__(self, server_secret: bytes) -> None:
        self._secret = server_secret

    @classmethod
    def load(cls, sf: sessionmaker[Session], keys: KeyManager) -> Identity:
        wrapped = meta_get(sf, _SECRET_KEY)
        if wrapped is None:
            secret = secrets.token_bytes(32)
            meta_set(sf, _SECRET_KEY, keys.wrap(secret, "server-secret").hex())
            return cls(secret)
        return cls(keys.unwrap(bytes.fromhex(wrapped), "server-secret"))

    def tenant_for(self, user: str) -> TenantId:
        return tenant_for_user(self._secret, user)

    def subject_hash(self, user: str) -> str:
        """The salted hash of a user id written into erasure receipts (never the id itself)."""
        return hashlib.blake2b(
            b"dss-subject\x00" + user.encode(), key=self._secret[:32], digest_size=20
        ).hexdigest()

    def rpc_authkey(self) -> bytes:
        """The engines' RPC authkey: the same for every owner of this store, so an engine
        configured with it reaches a restarted owner."""
        return rpc_authkey(self._secret)
