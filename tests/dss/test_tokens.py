"""Token ids as the store keeps them (`dss.tokens.as_tokens`): every input shape the store is
given comes out as the same contiguous little-endian int32 array, and ids that are not 32-bit
ints are refused, never truncated."""

from __future__ import annotations

import numpy as np
import pytest

from dss.tokens import TOKEN_DTYPE, as_tokens


def test_lists_tuples_and_arrays_give_the_same_writable_int32_array() -> None:
    ids = [0, 1, 49151, -1, 2**31 - 1, -(2**31)]
    want = np.array(ids, dtype=np.int64).astype(TOKEN_DTYPE)
    for given in (ids, tuple(ids), np.array(ids, dtype=np.int64), [np.int64(i) for i in ids]):
        got = as_tokens(given)
        assert got.dtype == TOKEN_DTYPE and got.flags.c_contiguous and got.flags.writeable
        assert got.tolist() == want.tolist()
    assert as_tokens([]).shape == (0,)
    arr = np.arange(5, dtype=TOKEN_DTYPE)
    assert as_tokens(arr) is arr  # no copy of what is already the store's form


@pytest.mark.parametrize("bad", [[2**31], [-(2**31) - 1], [1.5], [[1, 2]], ["7"]])
def test_ids_that_are_not_32_bit_ints_are_refused(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        as_tokens(bad)  # type: ignore[arg-type]
