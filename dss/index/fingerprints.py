"""The model fingerprints a data directory knows: registered by the engines, kept in `store_meta`.

Lock: `FingerprintRegistry._lock` is a leaf around the in-memory dict; the database write runs
outside it (two engines registering the same fingerprint write the same row twice, harmlessly).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from sqlalchemy.orm import Session, sessionmaker

from dss.db.store_meta import meta_set, meta_with_prefix
from dss.errors import FingerprintMismatch, InvalidInput
from dss.namespace import ModelFingerprint
from dss.types import FingerprintId

_PREFIX = "fingerprint:"


class FingerprintRegistry:
    def __init__(self, session_factory: sessionmaker[Session], bf16_only_codec: str | None = None) -> None:
        """`bf16_only_codec`: a lossy page codec the store encodes with (`int8`), which quantizes
        bf16 values: an engine whose KV is in another dtype (float32, an fp8 cache's bytes) is
        refused when it registers, instead of having its pages decoded as other values."""
        self._sf = session_factory
        self._bf16_only_codec = bf16_only_codec
        self._lock = threading.Lock()
        self._known: dict[FingerprintId, ModelFingerprint] = {}
        for value in meta_with_prefix(session_factory, _PREFIX).values():
            fp = ModelFingerprint.from_json(value)
            self._known[fp.id] = fp

    def register(self, fp: ModelFingerprint) -> FingerprintId:
        if self._bf16_only_codec is not None and fp.dtype != "bfloat16":
            raise InvalidInput(
                f"the page codec {self._bf16_only_codec!r} quantizes bfloat16 KV only; this engine's KV "
                f"is {fp.dtype}" + (f" ({fp.kv_cache_dtype})" if fp.kv_cache_dtype != "auto" else "")
            )
        fid = fp.id
        with self._lock:
            known = fid in self._known
        if not known:
            meta_set(self._sf, _PREFIX + fid, fp.to_json())
            with self._lock:
                self._known.setdefault(fid, fp)
        return fid

    def get(self, fid: FingerprintId) -> ModelFingerprint:
        with self._lock:
            fp = self._known.get(fid)
        if fp is None:
            raise FingerprintMismatch(f"unknown model fingerprint {fid}")
        return fp

    def __contains__(self, fid: object) -> bool:
        with self._lock:
            return fid in self._known

    def __iter__(self) -> Iterator[FingerprintId]:
        with self._lock:
            return iter(list(self._known))

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)
