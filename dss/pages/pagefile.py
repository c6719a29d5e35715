"""The at-rest format of one page: a fixed binary header, then the body.

    header (HEADER_LEN bytes, little-endian, see `_FIELDS`)
    body   = tokens ‖ payload                                        when not encrypted
           = AES-GCM(data_key, tokens ‖ payload, aad = header fields)  when encrypted

`tokens` are the page's token ids (int32 LE), needed to rebuild the index after a restart; they
are user content, so they sit inside the encrypted body. `payload` is the codec's output.

Every byte is verified on decode, so a damaged file raises `CorruptPage` and never yields wrong
bytes: `header_check` covers the header (so `read_header` alone detects a damaged header),
`body_check` (xxh3-64) covers the body as stored (checked before anything is decrypted or
decompressed, which also tells damage apart from a wrong key), `checksum` (xxh3-128) covers the
decoded page, and when encrypted the AES-GCM tag covers the body and, as associated data, the
header fields.

`checksum` is the xxh3-128 of the raw page for lossless codecs (it equals `PageMeta.checksum`).
For a lossy codec it is the checksum of what decoding yields (flag `FLAG_LOSSY`), since the
original bytes cannot come back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from dss.errors import CorruptPage, InvalidInput, PageShapeMismatch
from dss.keys import crypto
from dss.pages.codec import Codec, codec_by_id
from dss.pages.meta import PageMeta
from dss.tokens import TOKEN_DTYPE, as_tokens
from dss.types import HASH_BYTES, Buffer, NamespaceId, PageHash, TenantId

MAGIC = b"DSSP"
FORMAT_VERSION = 1
FLAG_ENCRYPTED = 1 << 0
FLAG_LOSSY = 1 << 1
_KNOWN_FLAGS = FLAG_ENCRYPTED | FLAG_LOSSY
TENANT_FIELD_BYTES = 32

# The header is `_FIELDS` (also the AES-GCM associated data) followed by `_TRAILER`:
# body_check (xxh3-64 of the body as stored) and header_check (xxh3-64 of everything before it).
# magic, version, codec id, flags, namespace, tenant, page hash, parent hash, page index,
# n_tokens, raw_len, body_len, checksum
_FIELDS = struct.Struct("<4sHHI16s32s32s32sIIQQ16s")
_TRAILER = struct.Struct("<QQ")
HEADER_LEN = _FIELDS.size + _TRAILER.size
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
    body_check: int
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


def _body_check(body: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(body)


def _tenant_field(tenant: str) -> bytes:
    try:
        encoded = tenant.encode("ascii")
    except UnicodeEncodeError:
        encoded = b""
    if not encoded or len(encoded) > TENANT_FIELD_BYTES or b"\x00" in encoded:
        raise InvalidInput(f"tenant id {tenant!r} is not 1-{TENANT_FIELD_BYTES} ASCII characters")
    return encoded.ljust(TENANT_FIELD_BYTES, b"\x00")


def _pack_fields(
    meta: PageMeta, codec_id: int, flags: int, raw_len: int, body_len: int, check: bytes
) -> bytes:
    if len(meta.hash) != HASH_BYTES or len(meta.parent) != HASH_BYTES or len(meta.namespace) != 16:
        raise InvalidInput("page hash and parent must be 32 bytes, namespace id 16 bytes")
    return _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        flags,
        meta.namespace,
        _tenant_field(meta.tenant),
        meta.hash,
        meta.parent,
        meta.index,
        len(meta.tokens),
        raw_len,
        body_len,
        check,
    )


def _seal_header(fields: bytes, body: Buffer) -> bytes:
    checked = fields + struct.pack("<Q", _body_check(body))
    return checked + struct.pack("<Q", xxhash.xxh3_64_intdigest(checked))


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
    if data_key is None:
        body = tokens_bytes + payload
        fields = _pack_fields(meta, codec.codec_id, flags, len(raw_view), len(body), stored_check)
    else:
        flags |= FLAG_ENCRYPTED
        body_len = crypto.NONCE_BYTES + len(tokens_bytes) + len(payload) + crypto.TAG_BYTES
        fields = _pack_fields(meta, codec.codec_id, flags, len(raw_view), body_len, stored_check)
        body = crypto.encrypt(data_key, tokens_bytes + payload, fields)
    return _seal_header(fields, body) + body


def read_header(blob_or_prefix: Buffer) -> PageFileHeader:
    """Parse and verify the header from the first `HEADER_LEN` bytes of a page file."""
    view = memoryview(blob_or_prefix).cast("B")
    if len(view) < HEADER_LEN:
        raise CorruptPage(f"page file truncated inside its header ({len(view)} < {HEADER_LEN} bytes)")
    (magic, version, codec_id, flags, ns, tenant, page, parent, index, n_tokens, raw_len, body_len, check) = (
        _FIELDS.unpack_from(view, 0)
    )
    bcheck, hcheck = _TRAILER.unpack_from(view, _FIELDS.size)
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
        body_check=bcheck,
    )


def decode_page(
    blob: Buffer, data_key: bytes | None, elem_bytes: int = 2, out: np.ndarray | None = None
) -> tuple[PageFileHeader, np.ndarray, bytearray | bytes | memoryview]:
    """Verify and decode a whole page file: (header, token ids, raw page bytes).

    With `out` (a writable uint8 array of the page's size, e.g. a reserved arena slot) the page
    is decoded in place and a memoryview of `out` is returned as the raw bytes; on `CorruptPage`
    its content is undefined (a reserved slot is released, which zeroes it).

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
    if _body_check(body) != header.body_check:
        raise CorruptPage("page file body fails its checksum")
    if data_key is not None:
        try:
            body = memoryview(crypto.decrypt(data_key, body, bytes(view[: _FIELDS.size])))
        except CorruptPage as exc:
            # The stored bytes passed body_check, so the key is what does not fit.
            raise CorruptPage(
                "page fails authentication under the given data key (wrong or destroyed key)"
            ) from exc
    tokens_len = header.n_tokens * TOKEN_DTYPE.itemsize
    if len(body) < tokens_len:
        raise CorruptPage("page body is shorter than its token ids")
    tokens_bytes = body[:tokens_len]
    tokens = np.frombuffer(tokens_bytes, dtype=TOKEN_DTYPE).copy()
    raw: bytearray | bytes | memoryview
    if out is None:
        raw = codec.decode(body[tokens_len:], header.raw_len, elem_bytes)
    else:
        if out.size != header.raw_len:
            raise InvalidInput(f"output buffer has {out.size} bytes, the page has {header.raw_len}")
        codec.decode_into(body[tokens_len:], out, elem_bytes)
        raw = out.data
    if len(raw) != header.raw_len or checksum(raw) != header.checksum:
        raise CorruptPage("page bytes fail their checksum")
    return header, tokens, raw


def decode_page_of(
    blob: Buffer, page: PageHash, data_key: bytes | None, out: np.ndarray | None = None
) -> tuple[PageFileHeader, np.ndarray, bytearray | bytes | memoryview]:
    """`decode_page` of bytes a tier keeps under `page`'s name: bytes of another page (a misnamed
    file, a swapped value) are as corrupt as damaged ones."""
    header, tokens, raw = decode_page(blob, data_key, out=out)
    if header.page_hash != page:
        raise CorruptPage(f"the bytes stored as page {page.hex()} hold page {header.page_hash.hex()}")
    return header, tokens, raw
