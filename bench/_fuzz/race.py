"""`EraseRacer`: erasures of one user racing a schemathesis run as that user; every answer must be a
receipt without remnants, and every receipt is verified again at the end."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx


class EraseRacer(threading.Thread):
    """Erases one user every `period` s (one time in three twice at once) with the admin key while
    schemathesis runs as that user: every answer must be a receipt (200) whose verification holds
    no remnant; the receipts are verified again once the run is over (`remnants`)."""

    def __init__(self, base_url: str, admin_key: str, user: str, period: float, deadline: float) -> None:
        super().__init__(name="erase-racer", daemon=True)
        self.base_url, self.user, self.period = base_url, user, period
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.deadline = deadline
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.receipts: list[str] = []
        self.counts: dict[str, int] = {"erasures": 0, "errors_5xx": 0, "hangs": 0, "other": 0}
        self.remnants_at_erasure = 0
        self.findings: list[dict[str, Any]] = []

    def _count(self, key: str, finding: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if finding is not None and len(self.findings) < 20:
                self.findings.append(finding)

    def erase(self) -> None:
        path = f"/v1/users/{self.user}"
        t0 = time.monotonic()
        try:
            r = httpx.delete(self.base_url + path, headers=self.headers, timeout=self.deadline)
        except httpx.TimeoutException:
            self._count("hangs", {"request": f"DELETE {path}", "answer": f"none in {self.deadline:.0f} s"})
            return
        except httpx.HTTPError as exc:
            self._count("other", {"request": f"DELETE {path}", "answer": repr(exc)})
            return
        if r.status_code != 200:
            key = "errors_5xx" if r.status_code >= 500 else "other"
            self._count(key, {"request": f"DELETE {path}", "status": r.status_code, "answer": r.text[:1000]})
            return
        receipt = r.json()
        ver = receipt.get("verification") or {}
        held_nothing = bool(receipt.get("held_nothing"))  # an erasure of nothing writes no receipt
        bad = 0 if held_nothing else int(ver.get("remnants") or 0) + (0 if ver.get("chain_ok") else 1)
        with self.lock:
            self.counts["erasures"] += 1
            if not held_nothing:
                self.receipts.append(receipt["id"])
            self.remnants_at_erasure += bad
            if bad and len(self.findings) < 20:
                self.findings.append({"request": f"DELETE {path}", "took_s": round(time.monotonic() - t0, 2),
                                      "verification": ver})  # fmt: skip

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.wait(self.period * rng.uniform(0.5, 1.5)):
            k = 2 if rng.random() < 1 / 3 else 1
            threads = [threading.Thread(target=self.erase, daemon=True) for _ in range(k)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(self.deadline + 5)

    def reverify(self) -> int:
        """The fresh verification of every receipt: the sum of their remnants."""
        bad = 0
        for rid in self.receipts:
            try:
                r = httpx.get(
                    f"{self.base_url}/v1/erasures/{rid}", headers=self.headers, timeout=self.deadline
                )
            except httpx.HTTPError as exc:
                bad += 1
                self.findings.append({"request": f"GET /v1/erasures/{rid}", "answer": repr(exc)})
                continue
            ver = r.json().get("verification") or {} if r.status_code == 200 else {}
            if r.status_code != 200 or ver.get("remnants") != 0 or not ver.get("chain_ok"):
                bad += max(1, int(ver.get("remnants") or 0))
                self.findings.append({"request": f"GET /v1/erasures/{rid}", "status": r.status_code,
                                      "answer": r.text[:1000]})  # fmt: skip
        return bad
