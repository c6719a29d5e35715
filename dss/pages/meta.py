"""What the store knows about one page, independent of where its bytes are."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dss.types import FingerprintId, NamespaceId, PageHash, TenantId


@dataclass(slots=True)
class PageMeta:
    """Identity and provenance of one page (one engine block of KV, all layers).

    `tokens` are the page's own `block_size` token ids (fewer for a tail page: the valid ones of a
    sequence's partial last block); with `parent` they let the index be rebuilt from the page
    table after a restart.
    """

    hash: PageHash
    namespace: NamespaceId
    tenant: TenantId
    fingerprint: FingerprintId
    parent: PageHash
    index: int  # position of the page in its sequence (0 = first block)
    nbytes: int
    tokens: np.ndarray = field(repr=False)
    checksum: bytes = b""  # xxh3-128 of the raw page bytes, set when first stored

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])
