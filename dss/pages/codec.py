"""Page codecs: how page bytes are compressed at rest, as small strategies chosen by name.

A codec turns raw page bytes into a self-describing payload and back. Its `codec_id` is stored
in every page file, so ids are stable forever: add new codecs with new ids, never renumber.

- `none` (id 0): stored as is.
- `zstd-byteplane` (id 1, lossless, the default): each `elem_bytes`-byte element is split into
  byte planes (all high bytes together, all low bytes together). The bf16 high byte (sign and
  exponent) is highly redundant and compresses well; the low byte (mantissa) is close to random,
  so a plane that zstd cannot shrink is stored raw, which costs no ratio and makes decoding
  nearly a memcpy for that half.
- `int8` (id 2, LOSSY, off by default): per-group-of-64 absmax int8 quantisation of bf16 values.
  Only for deployments that measured its effect on outputs.

Payloads that cannot be decoded raise `CorruptPage`: a codec only ever sees bytes that were
meant to be one of its payloads, so a malformed one is damaged data.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import zstandard

from dss.errors import CorruptPage, InvalidInput
from dss.types import Buffer


@runtime_checkable
class Codec(Protocol):
    name: str
    codec_id: int
    lossless: bool

    def encode(self, raw: Buffer, elem_bytes: int = 2) -> bytes: ...

    def decode(self, data: Buffer, raw_len: int, elem_bytes: int = 2) -> bytearray | bytes: ...

    def decode_into(self, data: Buffer, out: np.ndarray, elem_bytes: int = 2) -> None:
        """Decode into `out` (a writable uint8 array of exactly the raw length, e.g. an arena slot)."""
        ...


def _out_array(out: np.ndarray | Buffer) -> np.ndarray:
    arr = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise InvalidInput("decode_into needs a writable, contiguous 1-D uint8 array")
    return arr


def _decode_via_into(codec: Codec, data: Buffer, raw_len: int, elem_bytes: int) -> bytearray:
    out = bytearray(raw_len)
    codec.decode_into(data, np.frombuffer(out, dtype=np.uint8), elem_bytes)
    return out


def _as_u8(buf: Buffer) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


class NoneCodec:
    name = "none"
    codec_id = 0
    lossless = True

    def encode(self, raw: Buffer, elem_bytes: int = 2) -> bytes:
        return bytes(raw)

    def decode(self, data: Buffer, raw_len: int, elem_bytes: int = 2) -> bytearray | bytes:
        if len(data) != raw_len:
            raise CorruptPage(f"uncompressed payload has {len(data)} bytes, expected {raw_len}")
        return bytes(data)

    def decode_into(self, data: Buffer, out: np.ndarray, elem_bytes: int = 2) -> None:
        arr = _out_array(out)
        if len(data) != arr.size:
            raise CorruptPage(f"uncompressed payload has {len(data)} bytes, expected {arr.size}")
        arr[:] = _as_u8(data)


# --- byte planes + zstd -------------------------------------------------------------------------
# Payload: u8 plane count P, then P entries (u8 mode, u32 stored length), then the P plane bodies.
_BP_HEAD = struct.Struct("<B")
_BP_ENTRY = struct.Struct("<BI")
_MODE_RAW = 0
_MODE_ZSTD = 1
# A plane is compressed only when a sample of it shrinks below this fraction: a 2-3% gain is not
# worth decoding zstd over half of the page on every load.
_DEFAULT_MAX_PLANE_RATIO = 0.97
_SAMPLE_BYTES = 64 * 1024


class _ZstdContexts(threading.local):
    """zstd contexts are not thread-safe; reusing one per thread avoids re-allocating windows."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        cctx = self.compressors.get(level)
        if cctx is None:
            cctx = self.compressors[level] = zstandard.ZstdCompressor(level=level)
        return cctx


_ZSTD = _ZstdContexts()


class BytePlaneZstdCodec:
    name = "zstd-byteplane"
    codec_id = 1
    lossless = True

    def __init__(self, level: int = 1, max_plane_ratio: float = _DEFAULT_MAX_PLANE_RATIO) -> None:
        if not -7 <= level <= 22:
            raise InvalidInput(f"zstd level {level} out of range [-7, 22]")
        self.level = level
        self.max_plane_ratio = max_plane_ratio

    def encode(self, raw: Buffer, elem_bytes: int = 2) -> bytes:
        u8 = _as_u8(raw)
        if elem_bytes < 1 or u8.size % elem_bytes:
            elem_bytes = 1  # odd-sized input: a single plane keeps the format total
        # .T of the (n, elem_bytes) view is the plane-major layout; copying it is the split.
        planes = np.ascontiguousarray(u8.reshape(-1, elem_bytes).T)
        cctx = _ZSTD.compressor(self.level)
        entries: list[bytes | memoryview] = [_BP_HEAD.pack(elem_bytes)]
        bodies: list[bytes | memoryview] = []
        for plane in planes:
            body: bytes | memoryview = plane.data
            mode = _MODE_RAW
            if self._worth_compressing(cctx, plane):
                packed = cctx.compress(plane.data)
                if len(packed) < plane.size:
                    body, mode = packed, _MODE_ZSTD
            entries.append(_BP_ENTRY.pack(mode, len(body)))
            bodies.append(body)
        return b"".join(entries + bodies)

    def _worth_compressing(self, cctx: zstandard.ZstdCompressor, plane: np.ndarray) -> bool:
        if plane.size <= 2 * _SAMPLE_BYTES:
            return True
        mid = plane.size // 2
        sample = plane[mid : mid + _SAMPLE_BYTES]
        return len(cctx.compress(sample.data)) < self.max_plane_ratio * sample.size

    def decode(self, data: Buffer, raw_len: int, elem_bytes: int = 2) -> bytearray | bytes:
        return _decode_via_into(self, data, raw_len, elem_bytes)

    def decode_into(self, data: Buffer, out: np.ndarray, elem_bytes: int = 2) -> None:
        arr = _out_array(out)
        raw_len = arr.size
        view = memoryview(data).cast("B")
        try:
            (n_planes,) = _BP_HEAD.unpack_from(view, 0)
            if n_planes < 1 or raw_len % n_planes:
                raise CorruptPage(f"byte-plane payload names {n_planes} planes for {raw_len} bytes")
            plane_len = raw_len // n_planes
            entries = [
                _BP_ENTRY.unpack_from(view, _BP_HEAD.size + i * _BP_ENTRY.size) for i in range(n_planes)
            ]
        except struct.error as exc:
            raise CorruptPage(f"truncated byte-plane payload: {exc}") from exc
        pos = _BP_HEAD.size + n_planes * _BP_ENTRY.size
        if pos + sum(length for _, length in entries) != len(view):
            raise CorruptPage("byte-plane payload length does not match its plane table")

        dctx = _ZSTD.decompressor
        planes: list[np.ndarray] = []
        for i, (mode, length) in enumerate(entries):
            body = view[pos : pos + length]
            pos += length
            if mode == _MODE_RAW:
                plane: bytes | memoryview = body
            elif mode == _MODE_ZSTD:
                try:
                    # A damaged frame header may claim any size; check it before zstd allocates it.
                    if zstandard.frame_content_size(body) != plane_len:
                        raise CorruptPage(f"zstd plane {i} does not hold {plane_len} bytes")
                    plane = dctx.decompress(body, max_output_size=plane_len)
                except zstandard.ZstdError as exc:
                    raise CorruptPage(f"zstd plane {i} does not decode: {exc}") from exc
            else:
                raise CorruptPage(f"unknown byte-plane mode {mode}")
            if len(plane) != plane_len:
                raise CorruptPage(f"plane {i} has {len(plane)} bytes, expected {plane_len}")
            planes.append(_as_u8(plane))
        _interleave(planes, arr)


def _interleave(planes: list[np.ndarray], out: np.ndarray) -> None:
    if len(planes) == 1:
        out[:] = planes[0]
    elif len(planes) == 2:
        # Two whole-array integer ops beat two strided byte copies by about 2x.
        words = out.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype=words.dtype)
        np.bitwise_or(words, planes[0], out=words)
    else:
        strided = out.reshape(-1, len(planes)).T
        for i, plane in enumerate(planes):
            strided[i] = plane


# --- int8 (lossy) -------------------------------------------------------------------------------
INT8_GROUP = 64
_BF16_ONE_ULP = 2.0**-8  # relative rounding error of bf16


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; inputs are finite here."""
    u32 = f32.view(np.uint32)
    rounded = u32 + (0x7FFF + ((u32 >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


class Int8Codec:
    """LOSSY per-group absmax int8 quantisation of bf16 values; off by default.

    Payload: float32 scale per group of 64 values, then one int8 per value. The error of a value
    is at most half a quantisation step (group absmax / 254) plus bf16 rounding of the result.
    Non-finite values cannot be quantised and are rejected.
    """

    name = "int8"
    codec_id = 2
    lossless = False
    error_bound_doc: ClassVar[str] = "|x - y| <= absmax(group)/254 + |y| * 2**-8"

    def encode(self, raw: Buffer, elem_bytes: int = 2) -> bytes:
        if elem_bytes != 2 or len(raw) % 2:
            raise InvalidInput("the int8 codec quantises bf16 values only (elem_bytes=2, even length)")
        values = _bf16_to_f32(np.frombuffer(raw, dtype="<u2"))
        if not np.isfinite(values).all():
            raise InvalidInput("the int8 codec cannot quantise non-finite values")
        groups = _pad_groups(values)
        absmax = np.abs(groups).max(axis=1)
        scale = (absmax / 127.0).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.rint(groups / safe[:, None]).clip(-127, 127).astype(np.int8)
        return b"".join((scale.astype("<f4").data, q.reshape(-1)[: values.size].data))

    def decode(self, data: Buffer, raw_len: int, elem_bytes: int = 2) -> bytearray | bytes:
        return _decode_via_into(self, data, raw_len, elem_bytes)

    def decode_into(self, data: Buffer, out: np.ndarray, elem_bytes: int = 2) -> None:
        arr = _out_array(out)
        raw_len = arr.size
        n = raw_len // 2
        n_groups = -(-n // INT8_GROUP)
        if raw_len % 2 or len(data) != 4 * n_groups + n:
            raise CorruptPage(f"int8 payload has {len(data)} bytes, not the size for {raw_len} raw bytes")
        scale = np.frombuffer(data, dtype="<f4", count=n_groups)
        q = np.frombuffer(data, dtype=np.int8, offset=4 * n_groups)
        padded = np.zeros(n_groups * INT8_GROUP, dtype=np.float32)
        padded[:n] = q
        values = (padded.reshape(n_groups, INT8_GROUP) * scale[:, None]).reshape(-1)[:n]
        arr.view("<u2")[:] = _f32_to_bf16(np.ascontiguousarray(values))


def _pad_groups(values: np.ndarray) -> np.ndarray:
    n_groups = -(-values.size // INT8_GROUP)
    if values.size == n_groups * INT8_GROUP:
        return values.reshape(n_groups, INT8_GROUP)
    padded = np.zeros(n_groups * INT8_GROUP, dtype=np.float32)
    padded[: values.size] = values
    return padded.reshape(n_groups, INT8_GROUP)


# --- registry -----------------------------------------------------------------------------------
CODECS: dict[str, Callable[[], Codec]] = {
    NoneCodec.name: NoneCodec,
    BytePlaneZstdCodec.name: BytePlaneZstdCodec,
    Int8Codec.name: Int8Codec,
}
DEFAULT_CODEC = BytePlaneZstdCodec.name
_BY_ID: dict[int, Callable[[], Codec]] = {
    NoneCodec.codec_id: NoneCodec,
    BytePlaneZstdCodec.codec_id: BytePlaneZstdCodec,
    Int8Codec.codec_id: Int8Codec,
}


def make_codec(name: str) -> Codec:
    """The codec of this name; `zstd-byteplane:<level>` names a zstd level (default 1)."""
    base, _, level = name.partition(":")
    if level and base == BytePlaneZstdCodec.name:
        try:
            return BytePlaneZstdCodec(level=int(level))
        except ValueError as exc:
            raise InvalidInput(f"bad zstd level in codec {name!r}") from exc
    factory = CODECS.get(name)
    if factory is None:
        raise InvalidInput(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    return factory()


def codec_by_id(codec_id: int) -> Codec:
    """The codec that decodes payloads stamped with `codec_id` (decoding needs no parameters)."""
    factory = _BY_ID.get(codec_id)
    if factory is None:
        raise InvalidInput(f"unknown codec id {codec_id}")
    return factory()
