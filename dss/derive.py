"""Unambiguous input for every keyed hash the store derives: tenants, receipt subjects, namespace
ids, session-tag MACs, the RPC authkey, and the associated data of sealed page tokens.

Joining fields with a separator is ambiguous as soon as a field may contain the separator: the
tenant HMAC used to be `"dss-tenant\\0" + user + "\\0epoch\\0" + n`, so the user
`"alice\\0epoch\\01"` at epoch 0 had the tenant of `"alice"` at epoch 1. Here every field,
the label first, is written as its length (4 bytes, big-endian) and then its bytes, so two
different field lists never give the same input. A field's type is fixed by its position in
each caller (an `int` is its decimal digits, a `str` its UTF-8).

Content addresses whose fields have fixed lengths (page and tail hashes: a 16-byte namespace
id, a 32-byte parent hash, then the token ids), the message digest chain (a 32-byte state, then
one canonical JSON message) and the receipt chain (a 64-hex hash, then canonical JSON) are
unambiguous as they are and stay (changing the receipt chain would break old receipts).

Stdlib only: engine processes import it (through `dss.wire`).
"""

from __future__ import annotations

import hashlib
import hmac

Field = str | bytes | int

_LEN_BYTES = 4
_RPC_AUTHKEY_LABEL = "dss/rpc-authkey/v2"


def encode_fields(label: str, *fields: Field) -> bytes:
    """`label` and each field, each prefixed by its length."""
    out = bytearray()
    for f in (label, *fields):
        if isinstance(f, bool):
            raise TypeError("a derivation field is str, bytes or int, not bool")
        b = f.encode() if isinstance(f, str) else str(f).encode() if isinstance(f, int) else bytes(f)
        out += len(b).to_bytes(_LEN_BYTES, "big") + b
    return bytes(out)


def hmac_sha256(key: bytes, label: str, *fields: Field) -> bytes:
    return hmac.new(key, encode_fields(label, *fields), hashlib.sha256).digest()


def keyed_blake2b(key: bytes, label: str, *fields: Field, digest_size: int) -> bytes:
    return hashlib.blake2b(encode_fields(label, *fields), key=key, digest_size=digest_size).digest()


def blake2b(label: str, *fields: Field, digest_size: int) -> bytes:
    return hashlib.blake2b(encode_fields(label, *fields), digest_size=digest_size).digest()


def rpc_authkey(server_secret: bytes) -> bytes:
    """The RPC authkey of a store: HMAC-SHA256 of a fixed label under the store's server secret.

    Stable across restarts of the owner of one data directory, so that engines configured with
    the key of a previous owner are accepted by the one that replaces it."""
    if not server_secret:
        raise ValueError("server secret must not be empty")
    return hmac_sha256(server_secret, _RPC_AUTHKEY_LABEL)
