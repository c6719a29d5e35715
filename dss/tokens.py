"""Token ids as the store keeps them: contiguous little-endian int32 arrays.

One home for the representation every part shares (content addresses in `dss.index`, page files
and sealed page tokens in `dss.pages`, versions in `dss.dialogue`), so none of them imports
another for it. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no copy when already one)."""
    arr = np.asarray(tokens, dtype=TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    return np.ascontiguousarray(arr)
