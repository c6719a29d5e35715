"""The page file format and the disk tier: every damaged byte is caught, writes are atomic."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dss.errors import (
    CapacityError,
    CorruptPage,
    InvalidInput,
    PageMissing,
    PageShapeMismatch,
    TierUnavailable,
)
from dss.index.hashing import ROOT_PARENT, page_hash
from dss.pages.codec import BytePlaneZstdCodec, Int8Codec, NoneCodec, make_codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import HEADER_LEN, checksum, decode_page, encode_page, read_header
from dss.pages.tiers.disk import DiskTier
from dss.types import PUBLIC_TENANT, FingerprintId, NamespaceId, TenantId

NS = NamespaceId(b"n" * 16)
TENANT = TenantId("0123456789abcdef0123456789abcdef")
KEY = bytes(range(32))
BLOCK = 16
PAGE_NBYTES = 8192


def bf16_page(seed: int, n: int = PAGE_NBYTES) -> bytes:
    values = torch.from_numpy(np.random.default_rng(seed).normal(0, 1, n // 2).astype(np.float32))
    return values.to(torch.bfloat16).view(torch.uint16).numpy().tobytes()


def make_meta(seed: int, raw: bytes, tenant: TenantId = TENANT, index: int = 0) -> PageMeta:
    tokens = np.random.default_rng(seed).integers(0, 50_000, BLOCK, dtype=np.int32)
    return PageMeta(
        hash=page_hash(NS, ROOT_PARENT, tokens),
        namespace=NS,
        tenant=tenant,
        fingerprint=FingerprintId("f" * 32),
        parent=ROOT_PARENT,
        index=index,
        nbytes=len(raw),
        tokens=tokens,
    )


# --- page file format ---------------------------------------------------------------------------
@pytest.mark.parametrize("data_key", [KEY, None])
def test_page_file_round_trip(data_key: bytes | None) -> None:
    raw = bf16_page(1)
    meta = make_meta(1, raw, index=7)
    blob = encode_page(meta, raw, BytePlaneZstdCodec(), data_key)
    assert meta.checksum == checksum(raw)
    header, tokens, out = decode_page(blob, data_key)
    assert bytes(out) == raw
    assert np.array_equal(tokens, meta.tokens) and tokens.dtype == np.dtype("<i4")
    assert header == read_header(blob[:HEADER_LEN])
    assert (header.page_hash, header.parent, header.namespace, header.tenant) == (
        meta.hash,
        meta.parent,
        NS,
        TENANT,
    )
    assert (header.index, header.n_tokens, header.raw_len, header.codec_id) == (7, BLOCK, len(raw), 1)
    assert header.encrypted == (data_key is not None) and header.checksum == meta.checksum
    assert header.file_len == len(blob)
    if data_key is not None:  # token ids are user content: not in the clear
        assert meta.tokens.tobytes() not in blob


def test_public_tenant_is_padded() -> None:
    raw = bf16_page(2)
    blob = encode_page(make_meta(2, raw, tenant=PUBLIC_TENANT), raw, NoneCodec(), None)
    assert read_header(blob).tenant == PUBLIC_TENANT


@pytest.mark.parametrize("data_key", [KEY, None])
def test_every_flipped_byte_is_caught(data_key: bytes | None) -> None:
    raw = bf16_page(3, 512)
    meta = make_meta(3, raw)
    blob = encode_page(meta, raw, BytePlaneZstdCodec(), data_key)
    for pos in range(len(blob)):
        for bit in (0x01, 0x80):
            damaged = bytearray(blob)
            damaged[pos] ^= bit
            with pytest.raises(CorruptPage):
                decode_page(bytes(damaged), data_key)


def test_truncated_or_extended_files_are_corrupt() -> None:
    raw = bf16_page(4)
    blob = encode_page(make_meta(4, raw), raw, BytePlaneZstdCodec(), KEY)
    for cut in (0, 3, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 5, len(blob) - 1):
        with pytest.raises(CorruptPage):
            decode_page(blob[:cut], KEY)
    with pytest.raises(CorruptPage):
        decode_page(blob + b"\x00", KEY)
    with pytest.raises(CorruptPage):
        read_header(blob[: HEADER_LEN - 1])


def test_key_mismatches() -> None:
    raw = bf16_page(5)
    encrypted = encode_page(make_meta(5, raw), raw, BytePlaneZstdCodec(), KEY)
    plain = encode_page(make_meta(5, raw), raw, BytePlaneZstdCodec(), None)
    with pytest.raises(CorruptPage):
        decode_page(encrypted, bytes(32))  # wrong (or destroyed and replaced) key
    with pytest.raises(InvalidInput):
        decode_page(encrypted, None)
    with pytest.raises(CorruptPage):
        decode_page(plain, KEY)  # a planted cleartext file where an encrypted one belongs


def test_encode_refuses_mismatched_bytes() -> None:
    raw = bf16_page(6)
    meta = make_meta(6, raw)
    meta.checksum = checksum(b"something else")
    with pytest.raises(CorruptPage):
        encode_page(meta, raw, NoneCodec(), None)
    with pytest.raises(PageShapeMismatch):
        encode_page(make_meta(6, raw[:-2]), raw, NoneCodec(), None)
    with pytest.raises(InvalidInput):
        encode_page(make_meta(6, raw, tenant=TenantId("ü" * 3)), raw, NoneCodec(), None)


def test_lossy_codec_checksums_what_it_decodes() -> None:
    raw = bf16_page(7)
    meta = make_meta(7, raw)
    blob = encode_page(meta, raw, Int8Codec(), KEY)
    header, _, out = decode_page(blob, KEY)
    assert header.lossy and meta.checksum == checksum(raw) != header.checksum
    assert len(out) == len(raw) and bytes(out) != raw


# --- disk tier ----------------------------------------------------------------------------------
@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    yield DiskTier(tmp_path / "pages", 1 << 20, make_codec("zstd-byteplane"))


def stored(disk: DiskTier, seed: int, key: bytes | None = KEY) -> PageMeta:
    raw = bf16_page(seed)
    meta = make_meta(seed, raw)
    disk.write(meta, raw, key)
    return meta


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_write_read_delete(disk: DiskTier) -> None:
    raw = bf16_page(1)
    meta = make_meta(1, raw)
    size = disk.write(meta, raw, KEY)
    hexname = meta.hash.hex()
    assert all_files(disk.root) == [f"{hexname[:2]}/{hexname}.page"]  # no temp file left
    assert size == disk.path_of(meta.hash).stat().st_size == disk.used_bytes
    assert disk.write(meta, raw, KEY) == size  # already present: a no-op
    header, tokens, out = disk.read(meta.hash, KEY)
    assert bytes(out) == raw and np.array_equal(tokens, meta.tokens)
    assert disk.read_header(meta.hash) == header
    assert disk.contains(meta.hash) and list(disk.keys()) == [meta.hash]
    assert disk.delete(meta.hash) == size and disk.used_bytes == 0
    assert disk.delete(meta.hash) == 0
    assert all_files(disk.root) == []
    with pytest.raises(PageMissing):
        disk.read(meta.hash, KEY)


def test_reopen_indexes_existing_files(disk: DiskTier) -> None:
    metas = [stored(disk, i) for i in range(5)]
    reopened = DiskTier(disk.root, 1 << 20, BytePlaneZstdCodec())
    assert sorted(reopened.keys()) == sorted(m.hash for m in metas)
    assert reopened.used_bytes == disk.used_bytes
    assert sorted(p for p, _, _ in reopened.scan()) == sorted(m.hash for m in metas)


def test_capacity(tmp_path: Path) -> None:
    raw = bf16_page(1)
    size = len(encode_page(make_meta(1, raw), raw, BytePlaneZstdCodec(), KEY))
    disk = DiskTier(tmp_path / "pages", 2 * size + size // 2, BytePlaneZstdCodec())
    stored(disk, 1)
    stored(disk, 2)
    with pytest.raises(CapacityError):
        stored(disk, 3)
    assert len(disk) == 2 and disk.available
    disk.delete(next(iter(disk.keys())))
    stored(disk, 3)
    assert len(all_files(disk.root)) == 2


def test_corrupt_file_is_deleted_and_counted(disk: DiskTier) -> None:
    meta = stored(disk, 1)
    path = disk.path_of(meta.hash)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPage):
        disk.read(meta.hash, KEY)
    assert disk.corrupt_pages == 1 and not path.exists() and not disk.contains(meta.hash)
    assert disk.used_bytes == 0


def test_misnamed_file_is_corrupt(disk: DiskTier) -> None:
    a, b = stored(disk, 1), stored(disk, 2)
    disk.path_of(a.hash).replace(disk.path_of(b.hash))  # b's name now holds a's page
    with pytest.raises(CorruptPage):
        disk.read(b.hash, KEY)
    assert disk.corrupt_pages == 1


def test_scan_skips_and_deletes_bad_headers(disk: DiskTier) -> None:
    good, damaged, truncated = stored(disk, 1), stored(disk, 2), stored(disk, 3)
    path = disk.path_of(damaged.hash)
    data = bytearray(path.read_bytes())
    data[40] ^= 1
    path.write_bytes(bytes(data))
    tpath = disk.path_of(truncated.hash)
    tpath.write_bytes(tpath.read_bytes()[:-1])
    found = {page: (header, size) for page, header, size in disk.scan()}
    assert list(found) == [good.hash]
    assert found[good.hash][0].page_hash == good.hash
    assert found[good.hash][1] == disk.path_of(good.hash).stat().st_size == disk.used_bytes
    assert disk.corrupt_pages == 2 and not path.exists() and not tpath.exists()


def test_gc_temp_removes_planted_temp_files(disk: DiskTier) -> None:
    meta = stored(disk, 1)
    final = disk.path_of(meta.hash)
    planted = [
        final.with_name(final.name + ".tmp-123-abcd"),
        disk.root / "ff" / ("ff" * 32 + ".page.tmp-9-0000"),
        disk.root / ".probe.tmp-1-2",
    ]
    for p in planted:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"partial")
    assert disk.gc_temp() == 3
    assert all(not p.exists() for p in planted) and final.exists()
    assert disk.gc_temp() == 0


def test_unwritable_directory_marks_tier_unavailable(disk: DiskTier) -> None:
    # Root bypasses permission bits, so the failure is made structural: the page's subdirectory
    # name is taken by a regular file, and mkdir/rename under it fail (ENOTDIR / EEXIST).
    raw = bf16_page(1)
    meta = make_meta(1, raw)
    blocker = disk.path_of(meta.hash).parent
    blocker.write_bytes(b"not a directory")
    with pytest.raises(TierUnavailable):
        disk.write(meta, raw, KEY)
    assert not disk.available and disk.used_bytes == 0
    other_raw = bf16_page(2)
    with pytest.raises(TierUnavailable):  # fails fast while unavailable
        disk.write(make_meta(2, other_raw), other_raw, KEY)
    assert disk.probe()  # the root itself is writable again
    blocker.unlink()
    disk.write(meta, raw, KEY)
    assert disk.available and bytes(disk.read(meta.hash, KEY)[2]) == raw
    assert not [p for p in all_files(disk.root) if ".tmp-" in p]


def test_probe_fails_when_root_is_gone(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "pages", 1 << 20, BytePlaneZstdCodec())
    (tmp_path / "pages").rmdir()
    (tmp_path / "pages").write_bytes(b"a file where the root was")
    assert not disk.probe() and not disk.available
    raw = bf16_page(1)
    with pytest.raises(TierUnavailable):
        disk.write(make_meta(1, raw), raw, KEY)
    with pytest.raises(TierUnavailable):
        DiskTier(tmp_path / "pages" / "sub", 1 << 20, BytePlaneZstdCodec())


def test_write_without_fsync_and_without_key(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "pages", 1 << 20, NoneCodec(), fsync=False)
    meta = stored(disk, 9, key=None)
    header, _, out = disk.read(meta.hash, None)
    assert not header.encrypted and bytes(out) == bf16_page(9)
    assert os.stat(disk.path_of(meta.hash)).st_mode & 0o777 == 0o600


def test_read_decodes_straight_into_a_host_arena_slot(disk: DiskTier, tmp_path: Path) -> None:
    from dss.pages.tiers.host import HostTier

    meta = stored(disk, 1)
    host = HostTier(4 * PAGE_NBYTES, directory=tmp_path / "shm", pin_memory=False)
    try:
        ref = host.reserve(PAGE_NBYTES)
        _, tokens, raw = disk.read(meta.hash, KEY, out=host.slot_array(ref))
        host.publish(meta.hash, ref)
        assert bytes(host.get(meta.hash)) == bf16_page(1) == bytes(raw)
        assert np.array_equal(tokens, meta.tokens)
        with pytest.raises(InvalidInput):
            disk.read(meta.hash, KEY, out=np.zeros(PAGE_NBYTES - 2, dtype=np.uint8))
        assert disk.contains(meta.hash)  # a caller mistake is not corruption
    finally:
        host.close()


def test_failed_rename_leaves_no_temp_file(disk: DiskTier) -> None:
    raw = bf16_page(1)
    meta = make_meta(1, raw)
    disk.path_of(meta.hash).mkdir(parents=True)  # rename(file, directory) fails with EISDIR
    with pytest.raises(TierUnavailable):
        disk.write(meta, raw, KEY)
    assert all_files(disk.root) == [] and disk.used_bytes == 0 and not disk.contains(meta.hash)


def test_concurrent_writers_and_readers(disk: DiskTier) -> None:
    import threading

    errors: list[BaseException] = []
    metas = [make_meta(i, bf16_page(i)) for i in range(12)]

    def worker(k: int) -> None:
        try:
            for meta in metas[k::3]:
                disk.write(meta, bf16_page(metas.index(meta)), KEY)
            for meta in metas:  # pages of other threads may or may not be there yet
                if disk.contains(meta.hash):
                    assert bytes(disk.read(meta.hash, KEY)[2]) == bf16_page(metas.index(meta))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(disk) == 12 and disk.used_bytes == sum(p.stat().st_size for p in disk.root.rglob("*.page"))
