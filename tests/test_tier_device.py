"""The device tier on the CPU device, and (with CUDA) pinned host arenas and device copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dss.errors import CapacityError, InvalidInput, PageMissing
from dss.pages.tiers.base import PageTier
from dss.pages.tiers.device import DeviceTier
from dss.pages.tiers.host import HostTier
from dss.types import PageHash, Tier

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def h(i: int) -> PageHash:
    return PageHash(i.to_bytes(32, "big"))


def page_bytes(i: int, n: int = 1024) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_cpu_put_get_delete_capacity() -> None:
    tier = DeviceTier(3 * 1024, device="cpu")
    assert isinstance(tier, PageTier) and tier.tier is Tier.DEVICE
    assert tier.put(h(1), page_bytes(1)) == 1024
    assert tier.put(h(2), memoryview(bytearray(page_bytes(2)))) == 1024
    src = torch.frombuffer(bytearray(page_bytes(3)), dtype=torch.uint8)
    tier.put(h(3), src)
    src.zero_()  # the tier holds a copy, not the caller's tensor
    for i in (1, 2, 3):
        got = tier.get(h(i))
        assert got.dtype == torch.uint8 and got.device.type == "cpu"
        assert got.numpy().tobytes() == page_bytes(i)
    assert tier.put(h(1), page_bytes(1)) == 1024 and tier.used_bytes == 3 * 1024  # no-op
    with pytest.raises(CapacityError):
        tier.put(h(4), page_bytes(4))
    kept = tier.get(h(2))
    assert tier.delete(h(2)) == 1024 and tier.delete(h(2)) == 0
    assert not kept.any()  # zeroed before the memory goes back to the allocator
    with pytest.raises(PageMissing):
        tier.get(h(2))
    tier.put(h(4), page_bytes(4))
    assert sorted(tier.keys()) == [h(1), h(3), h(4)] and tier.free_bytes == 0


def test_non_byte_tensors_are_stored_as_their_bytes() -> None:
    tier = DeviceTier(1 << 20, device="cpu")
    values = torch.randn(2, 256).to(torch.bfloat16)
    tier.put(h(1), values)
    assert tier.used_bytes == 1024
    assert torch.equal(tier.get(h(1)).view(torch.bfloat16).reshape(2, 256), values)
    tier.put(h(2), np.arange(10, dtype=np.int32))
    assert tier.get(h(2)).numpy().view(np.int32).tolist() == list(range(10))


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(InvalidInput):
        DeviceTier(-1, device="cpu")


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_pages_from_pinned_host_arena(tmp_path: Path) -> None:
    host = HostTier(8 * 4096, directory=tmp_path / "shm", pin_memory=True)
    try:
        device = DeviceTier(4 * 4096, device="cuda")
        for i in range(4):
            host.put(h(i), page_bytes(i, 4096))
        # Async copies need page-locked memory; the arena is registered with CUDA.
        for i in range(4):
            device.put(h(i), torch.from_numpy(host.get_array(h(i))), non_blocking=True)
        torch.cuda.synchronize()
        for i in range(4):
            got = device.get(h(i))
            assert got.is_cuda and got.cpu().numpy().tobytes() == page_bytes(i, 4096)
        # And back: device -> arena slot (a promotion's reverse, e.g. for a save).
        ref = host.reserve(4096)
        host.slot_array(ref)[:] = device.get(h(2)).cpu().numpy()
        host.publish(h(10), ref)
        assert bytes(host.get(h(10))) == page_bytes(2, 4096)
        assert device.delete(h(0)) == 4096 and device.used_bytes == 3 * 4096
    finally:
        host.close()


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_default_device() -> None:
    tier = DeviceTier(1 << 20)
    tier.put(h(1), page_bytes(1))
    assert tier.get(h(1)).is_cuda
