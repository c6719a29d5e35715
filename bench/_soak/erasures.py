"""The run's log of user erasures (`DELETE /v1/users/{id}`), shared by the clients (their own
erasures), the operator (its racing ones) and the checks. An erasure is in the log from the moment
it is sent (`begin`) and ends when its answer arrives (`end`): a receipt, a refusal (`void`: it
erased nothing), or no answer (`unknown`: it may still commit, its end is +inf).

A version's request sent while an erasure of its user had not ended may have been taken by it
(`erased_since`): such a version is never counted lost. One lock, a leaf: nothing under it waits,
counts or does I/O."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from .calls import Erasure, Recorder


class ErasureLog:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.lock = threading.Lock()
        self.by_user: dict[str, list[Erasure]] = {}
        self.receipts: list[tuple[str, str]] = []  # (user, receipt id) of every erasure answered

    def begin(self, user: str, by: str, together: int = 1) -> Erasure:
        with self.lock:
            er = Erasure(user, time.monotonic(), by=by, together=together)
            self.by_user.setdefault(user, []).append(er)
            return er

    def end(
        self, er: Erasure, receipt: dict[str, Any] | None, unknown: bool = False, void: bool = False
    ) -> None:
        """Its answer (a receipt), or none: `unknown` when it may still commit (a hang), `void`
        when it was refused (4xx: nothing erased). A receipt whose verification found remnants
        or a broken chain counts in `remnants_at_erasure`."""
        if receipt is not None and not receipt.get("held_nothing"):  # nothing held: no receipt
            ver = receipt.get("verification") or {}
            bad = int(ver.get("remnants") or 0) + (0 if ver.get("chain_ok") else 1)
            if bad:
                self.rec.count("remnants_at_erasure", bad)
                self.rec.event(
                    "erasure_remnants",
                    user=er.user,
                    by=er.by,
                    together=er.together,
                    took_s=round(time.monotonic() - er.s, 3),
                    receipt=receipt.get("id"),
                    verification=ver,
                )
        with self.lock:
            er.void = void
            er.held_nothing = receipt is not None and bool(receipt.get("held_nothing"))
            er.e = float("inf") if unknown else time.monotonic()
            if receipt is not None and isinstance(receipt.get("id"), str):
                er.receipt = receipt["id"]
                self.receipts.append((er.user, receipt["id"]))

    def of(self, user: str) -> list[Erasure]:
        """The erasures of `user`, in the order they were sent."""
        with self.lock:
            return list(self.by_user.get(user, []))

    def started(self, user: str) -> int:
        with self.lock:
            return len(self.by_user.get(user, []))

    def all_receipts(self) -> list[tuple[str, str]]:
        with self.lock:
            return list(self.receipts)

    def some_receipt(self, rng: random.Random) -> str | None:
        with self.lock:
            return rng.choice(self.receipts)[1] if self.receipts else None

    def erased_since(self, user: str, q: float) -> bool:
        """An erasure of `user` began by now and had not ended when `q` (a request) was sent:
        what that request wrote may be gone legitimately."""
        with self.lock:
            return any(not er.void and (er.e is None or er.e > q) for er in self.by_user.get(user, []))
