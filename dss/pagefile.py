"""The at-rest format of one page: a fixed binary header, then the body.

    header (HEADER_LEN bytes, little-endian, see `_HEADER`)
    body   = tokens ‖ payload                          when not encrypted
           = AES-GCM(data_key, tokens ‖ payload, aad = header bytes)   when encrypted

`tokens` are the page's token ids (int32 LE), needed to rebuild the index after a restart; they
are user content, so they sit inside the encrypted body. `payload` is the codec's output.

Every byte is verified on decode, so a damaged file raises `CorruptPage` and never yields wrong
bytes: `header_check` covers the header (so `read_header` alone detects a damaged header),
`tokens_check` covers the token ids, `checksum` (xxh3-128) covers the decoded page, and when
encrypted the AES-GCM tag covers the body and, as associated data, the header.

`checksum` is the xxh3-128 of the raw page for lossless codecs (it equals `PageMeta.checksum`).
For a lossy codec it is the checksum of what decoding yields (flag `FLAG_LOSSY`), since the
original bytes cannot come back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from dss import crypto
from dss.codec import Buffer, Codec, codec_by_id
from dss.errors import CorruptPage, InvalidInput, PageShapeMismatch
from dss.hashing import HASH_BYTES, TOKEN_DTYPE, as_tokens
from dss.pages import PageMeta
from dss.types import NamespaceId, PageHash, TenantId

MAGIC = b"DSSP"
FORMAT_VERSION = 1
FLAG_ENCRYPTED = 1 << 0
FLAG_LOSSY = 1 << 1
_KNOWN_FLAGS = FLAG_ENCRYPTED | FLAG_LOSSY
TENANT_FIELD_BYTES = 32

# magic, version, codec id, flags, namespace, tenant, page hash, parent hash, page index,
# n_tokens, raw_len, body_len, checksum, tokens_check, header_check
_HEADER = struct.Struct("<4sHHI16s32s32s32sIIQQ16sQQ")
HEADER_LEN = _HEADER.size
_CHECKED_PREFIX_LEN = HEADER_LEN - 8  # everything before header_check


@dataclass(frozen=True, slots=True)
class PageFileHeader:
    version: int
    codec_id: int
    flags: int
    namespace: NamespaceId
    tenant: TenantId
    page_hash: PageHash
    parent: PageHash
    index: int
    n_tokens: int
    raw_len: int
    body_len: int
    checksum: bytes
    tokens_check: int
    header_len: int = HEADER_LEN

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    @property
    def lossy(self) -> bool:
        return bool(self.flags & FLAG_LOSSY)

    @property
    def file_len(self) -> int:
        return self.header_len + self.body_len


def checksum(raw: Buffer) -> bytes:
    return xxhash.xxh3_128_digest(raw)


def _tokens_check(tokens_bytes: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(tokens_bytes)


def _tenant_field(tenant: str) -> bytes:
    try:
        encoded = tenant.encode("ascii")
    except UnicodeEncodeError:
        encoded = b""
    if not encoded or len(encoded) > TENANT_FIELD_BYTES or b"\x00" in encoded:
        raise InvalidInput(f"tenant id {tenant!r} is not 1-{TENANT_FIELD_BYTES} ASCII characters")
    return encoded.ljust(TENANT_FIELD_BYTES, b"\x00")


def _pack_header(
    meta: PageMeta,
    codec_id: int,
    flags: int,
    n_tokens: int,
    raw_len: int,
    body_len: int,
    check: bytes,
    tcheck: int,
) -> bytes:
    if len(meta.hash) != HASH_BYTES or len(meta.parent) != HASH_BYTES or len(meta.namespace) != 16:
        raise InvalidInput("page hash and parent must be 32 bytes, namespace id 16 bytes")
    prefix = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        flags,
        meta.namespace,
        _tenant_field(meta.tenant),
        meta.hash,
        meta.parent,
        meta.index,
        n_tokens,
        raw_len,
        body_len,
        check,
        tcheck,
        0,
    )[:_CHECKED_PREFIX_LEN]
    return prefix + struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix))


def encode_page(
    meta: PageMeta, raw: Buffer, codec: Codec, data_key: bytes | None, elem_bytes: int = 2
) -> bytes:
    """The file bytes of one page. Sets `meta.checksum` when empty; a mismatching one is refused.

    A `meta.checksum` that does not match `raw` means the bytes changed since they were hashed
    (e.g. a reused slot), so they are refused with `CorruptPage` rather than persisted.
    """
    raw_view = memoryview(raw).cast("B")
    if meta.nbytes != len(raw_view):
        raise PageShapeMismatch(f"page has {len(raw_view)} bytes, its metadata says {meta.nbytes}")
    raw_check = checksum(raw_view)
    if not meta.checksum:
        meta.checksum = raw_check
    elif meta.checksum != raw_check:
        raise CorruptPage("page bytes do not match the checksum recorded in their metadata")

    tokens_bytes = as_tokens(meta.tokens).tobytes()
    payload = codec.encode(raw_view, elem_bytes)
    flags = 0
    stored_check = raw_check
    if not codec.lossless:
        flags |= FLAG_LOSSY
        stored_check = checksum(codec.decode(payload, len(raw_view), elem_bytes))
    if data_key is not None:
        flags |= FLAG_ENCRYPTED
        body_len = crypto.NONCE_BYTES + len(tokens_bytes) + len(payload) + crypto.TAG_BYTES
    else:
        body_len = len(tokens_bytes) + len(payload)
    header = _pack_header(
        meta,
        codec.codec_id,
        flags,
        len(meta.tokens),
        len(raw_view),
        body_len,
        stored_check,
        _tokens_check(tokens_bytes),
    )
    if data_key is not None:
        return header + crypto.encrypt(data_key, tokens_bytes + payload, header)
    return b"".join((header, tokens_bytes, payload))


def read_header(blob_or_prefix: Buffer) -> PageFileHeader:
    """Parse and verify the header from the first `HEADER_LEN` bytes of a page file."""
    view = memoryview(blob_or_prefix).cast("B")
    if len(view) < HEADER_LEN:
        raise CorruptPage(f"page file truncated inside its header ({len(view)} < {HEADER_LEN} bytes)")
    fields = _HEADER.unpack_from(view, 0)
    (magic, version, codec_id, flags, ns, tenant, page, parent, index, n_tokens, raw_len, body_len) = fields[
        :12
    ]
    check, tcheck, hcheck = fields[12:]
    if magic != MAGIC:
        raise CorruptPage(f"not a page file (magic {bytes(magic)!r})")
    if hcheck != xxhash.xxh3_64_intdigest(view[:_CHECKED_PREFIX_LEN]):
        raise CorruptPage("page file header fails its checksum")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"unsupported page file version {version}")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptPage(f"unknown page file flags {flags:#x}")
    return PageFileHeader(
        version=version,
        codec_id=codec_id,
        flags=flags,
        namespace=NamespaceId(ns),
        tenant=TenantId(tenant.rstrip(b"\x00").decode("ascii", errors="replace")),
        page_hash=PageHash(page),
        parent=PageHash(parent),
        index=index,
        n_tokens=n_tokens,
        raw_len=raw_len,
        body_len=body_len,
        checksum=check,
        tokens_check=tcheck,
    )


def decode_page(
    blob: Buffer, data_key: bytes | None, elem_bytes: int = 2
) -> tuple[PageFileHeader, np.ndarray, bytearray | bytes]:
    """Verify and decode a whole page file: (header, token ids, raw page bytes).

    Passing a data key demands an encrypted file: an unencrypted file where an encrypted one is
    expected could have been planted, so it is refused as corrupt.
    """
    view = memoryview(blob).cast("B")
    header = read_header(view)
    if len(view) != header.file_len:
        raise CorruptPage(f"page file has {len(view)} bytes, its header says {header.file_len}")
    if header.encrypted != (data_key is not None):
        if data_key is None:
            raise InvalidInput("page file is encrypted but no data key was given")
        raise CorruptPage("page file is not encrypted but its tenant's pages must be")
    try:
        codec = codec_by_id(header.codec_id)
    except InvalidInput as exc:
        raise CorruptPage(str(exc)) from exc

    body = view[HEADER_LEN:]
    if data_key is not None:
        body = memoryview(crypto.decrypt(data_key, body, bytes(view[:HEADER_LEN])))
    tokens_len = header.n_tokens * TOKEN_DTYPE.itemsize
    if len(body) < tokens_len:
        raise CorruptPage("page body is shorter than its token ids")
    tokens_bytes = body[:tokens_len]
    if _tokens_check(tokens_bytes) != header.tokens_check:
        raise CorruptPage("page token ids fail their checksum")
    tokens = np.frombuffer(tokens_bytes, dtype=TOKEN_DTYPE).copy()
    raw = codec.decode(body[tokens_len:], header.raw_len, elem_bytes)
    if len(raw) != header.raw_len or checksum(raw) != header.checksum:
        raise CorruptPage("page bytes fail their checksum")
    return header, tokens, raw
