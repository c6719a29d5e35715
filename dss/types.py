"""Small shared value types: ids and hashes are NewTypes, boundary objects are frozen dataclasses."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids as stored, hashed and sent between processes: little-endian int32."""

PageHash = NewType("PageHash", bytes)
"""32-byte chained content address of one page (see `dss.index.hashing`)."""

NamespaceId = NewType("NamespaceId", bytes)
"""16-byte id of a (model fingerprint, tenant) pair."""

FingerprintId = NewType("FingerprintId", str)
"""Hex digest of a `ModelFingerprint`."""

TenantId = NewType("TenantId", str)
"""Hex HMAC of a user id under the server secret, or `PUBLIC_TENANT`."""

UserId = NewType("UserId", str)
SessionId = NewType("SessionId", str)

PUBLIC_TENANT = TenantId("public")


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # shared by every server of a fleet (Redis); the others are per server

    @property
    def rank(self) -> int:
        """0 is the fastest tier."""
        return _TIER_RANK[self]


_TIER_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2, Tier.REMOTE: 3}
TIERS_FAST_TO_SLOW: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where a page lives: pages of different namespaces never match each other."""

    fingerprint: FingerprintId
    tenant: TenantId
    id: NamespaceId

    @property
    def is_public(self) -> bool:
        return self.tenant == PUBLIC_TENANT


Buffer = bytes | bytearray | memoryview
"""Raw bytes as callers hand them in."""
