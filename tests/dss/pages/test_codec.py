"""Page codecs: lossless round trips on synthetic and real KV bytes, int8 error bound, registry."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dss.errors import CorruptPage, InvalidInput
from dss.pages.codec import (
    CODECS,
    DEFAULT_CODEC,
    BytePlaneZstdCodec,
    Int8Codec,
    NoneCodec,
    codec_by_id,
    make_codec,
)
from tests.paths import REPO

# shared/ sits beside the checkout (../shared); /work/shared is where our machines keep it
KV_SAMPLE = (
    next(
        (p for p in (REPO.parent / "shared", Path("/work/shared")) if p.exists()),
        Path("/work/shared"),
    )
    / "data"
    / "kv_sample.bin"
)


def bf16_like(n: int, seed: int = 0) -> bytes:
    """Normal-ish values rounded to bf16, like KV activations."""
    values = torch.from_numpy(np.random.default_rng(seed).normal(0, 2, n).astype(np.float32))
    return values.to(torch.bfloat16).view(torch.uint16).numpy().tobytes()


def kv_pages() -> list[bytes]:
    if not KV_SAMPLE.exists():
        pytest.skip(f"{KV_SAMPLE} not present")
    shape = json.loads(KV_SAMPLE.with_suffix(".json").read_text())["shape"]
    arr = np.fromfile(KV_SAMPLE, dtype=np.uint8).reshape(shape[0], shape[1], -1)
    return [np.ascontiguousarray(arr[:, b]).tobytes() for b in range(shape[1])]


@pytest.mark.parametrize("name", ["none", "zstd-byteplane"])
@pytest.mark.parametrize("n_bytes", [0, 1, 2, 3, 4096, 100_001, 300_000])
def test_lossless_round_trip_synthetic(name: str, n_bytes: int) -> None:
    codec = make_codec(name)
    raw = (bf16_like(n_bytes // 2 + 1) + b"\x07")[:n_bytes]
    encoded = codec.encode(raw)
    assert bytes(codec.decode(encoded, len(raw))) == raw


@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
def test_byteplane_round_trip_elem_sizes(elem_bytes: int) -> None:
    codec = BytePlaneZstdCodec()
    raw = np.random.default_rng(1).integers(0, 16, 250_000, dtype=np.uint8).tobytes()
    encoded = codec.encode(raw, elem_bytes)
    assert len(encoded) < len(raw)  # 4 bits of entropy per byte must compress
    assert bytes(codec.decode(encoded, len(raw), elem_bytes)) == raw


def test_byteplane_on_real_kv_meets_ratio_and_skips_mantissa_plane() -> None:
    codec = BytePlaneZstdCodec()
    pages = kv_pages()
    encoded = [codec.encode(p) for p in pages]
    for page, blob in zip(pages, encoded, strict=True):
        assert bytes(codec.decode(blob, len(page))) == page
    ratio = sum(map(len, pages)) / sum(map(len, encoded))
    assert ratio >= 1.40, ratio
    # Plane table: the low (mantissa) plane is stored raw, the high plane compressed.
    n_planes, lo_mode, lo_len, hi_mode, _ = struct.unpack_from("<BBIBI", encoded[0])
    assert (n_planes, lo_mode, lo_len, hi_mode) == (2, 0, len(pages[0]) // 2, 1)


def test_byteplane_slices_of_real_kv_round_trip() -> None:
    codec = BytePlaneZstdCodec(level=3)
    page = kv_pages()[1]
    for start, stop in [(0, 2), (10, 98_314), (1000, 1001), (5, len(page))]:
        raw = page[start:stop]
        assert bytes(codec.decode(codec.encode(raw), len(raw))) == raw


def test_byteplane_damage_raises_corrupt_page() -> None:
    codec = BytePlaneZstdCodec()
    raw = bf16_like(50_000)
    blob = codec.encode(raw)
    with pytest.raises(CorruptPage):
        codec.decode(blob[:-1], len(raw))
    with pytest.raises(CorruptPage):
        codec.decode(blob, len(raw) + 2)
    with pytest.raises(CorruptPage):
        codec.decode(b"", len(raw))
    damaged = bytearray(blob)
    damaged[len(damaged) - 100] ^= 0xFF  # inside the zstd frame of the last plane
    try:
        out = codec.decode(bytes(damaged), len(raw))
    except CorruptPage:
        return
    # zstd frames carry no checksum by default: a flipped literal may decode to other bytes.
    # The page file's xxh3 checksum catches that case (tested in test_tier_disk.py).
    assert bytes(out) != raw


def test_none_codec_rejects_wrong_length() -> None:
    with pytest.raises(CorruptPage):
        NoneCodec().decode(b"abc", 4)


def test_int8_error_bound_and_ratio() -> None:
    codec = Int8Codec()
    assert codec.lossless is False
    for raw in (bf16_like(64 * 1000 + 17, seed=3), kv_pages()[0]):
        encoded = codec.encode(raw)
        assert len(raw) / len(encoded) > 1.85
        decoded = codec.decode(encoded, len(raw))
        assert len(decoded) == len(raw)
        x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().numpy()
        y = torch.frombuffer(bytearray(decoded), dtype=torch.bfloat16).float().numpy()
        padded = np.zeros(-(-x.size // 64) * 64, dtype=np.float32)
        padded[: x.size] = np.abs(x)
        absmax = np.repeat(padded.reshape(-1, 64).max(axis=1), 64)[: x.size]
        bound = absmax / 254 + np.abs(y) * 2.0**-8 + 1e-30
        assert np.all(np.abs(x - y) <= bound)
        assert np.abs(x - y).max() > 0  # it is lossy


def test_int8_rejects_what_it_cannot_quantise() -> None:
    codec = Int8Codec()
    with pytest.raises(InvalidInput):
        codec.encode(b"\x00\x00\x00", 2)
    with pytest.raises(InvalidInput):
        codec.encode(b"\x00\x00" * 4, 4)
    nan = np.array([0, 0x7FC0], dtype="<u2").tobytes()  # 0.0, NaN
    with pytest.raises(InvalidInput):
        codec.encode(nan)
    with pytest.raises(CorruptPage):
        codec.decode(b"\x00" * 10, 128)


def test_int8_zero_groups_decode_to_zero() -> None:
    raw = bytes(256)
    assert bytes(Int8Codec().decode(Int8Codec().encode(raw), len(raw))) == raw


def test_registry() -> None:
    assert set(CODECS) == {"none", "zstd-byteplane", "int8"}
    assert DEFAULT_CODEC == "zstd-byteplane" and make_codec(DEFAULT_CODEC).lossless
    for name in CODECS:
        codec = make_codec(name)
        assert codec.name == name
        assert type(codec_by_id(codec.codec_id)) is type(codec)
    assert [make_codec(n).codec_id for n in ("none", "zstd-byteplane", "int8")] == [0, 1, 2]
    with pytest.raises(InvalidInput):
        make_codec("lz4")
    with pytest.raises(InvalidInput):
        codec_by_id(99)
    with pytest.raises(InvalidInput):
        BytePlaneZstdCodec(level=99)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_into_matches_decode(name: str) -> None:
    codec = make_codec(name)
    raw = bf16_like(20_000, seed=9)
    blob = codec.encode(raw)
    out = np.full(len(raw), 0xAA, dtype=np.uint8)
    codec.decode_into(blob, out)
    assert out.tobytes() == bytes(codec.decode(blob, len(raw)))
    with pytest.raises(InvalidInput):
        codec.decode_into(blob, np.zeros(len(raw), dtype=np.uint8)[::2])  # not contiguous
    with pytest.raises(InvalidInput):
        codec.decode_into(blob, np.zeros(len(raw), dtype=np.uint8).view(np.uint16))
    with pytest.raises(CorruptPage):
        codec.decode_into(blob, np.zeros(len(raw) - 2, dtype=np.uint8))  # wrong size


def test_a_store_encoding_with_int8_refuses_an_engine_whose_kv_is_not_bf16(tmp_path: Path) -> None:
    """The int8 codec reads every page as bf16 values: a float32 engine's or an fp8 cache's pages
    would come back as other values. Such an engine is refused when it registers (the connector
    then fails its start), before any page is stored; bf16 engines register as before."""
    from dataclasses import replace

    from tests.store_helpers import SMALL_FP, open_store

    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm", codec="int8")
    try:
        assert store.fingerprints.register(SMALL_FP) == SMALL_FP.id
        fp8 = replace(SMALL_FP, dtype="uint8", kv_cache_dtype="fp8_e4m3")
        for fp, named in ((replace(SMALL_FP, dtype="float32"), "float32"), (fp8, "uint8 (fp8_e4m3)")):
            with pytest.raises(InvalidInput) as err:
                store.fingerprints.register(fp)
            assert (
                str(err.value)
                == f"the page codec 'int8' quantizes bfloat16 KV only; this engine's KV is {named}"
            )
            assert fp.id not in store.fingerprints
    finally:
        store.close()
