"""`EraseRacer`: erasures of one user racing a schemathesis run as that user; every answer must be a
receipt without remnants, and every receipt is verified again at the end. The user may be an end
user of a frontend, erased through the frontend key, with an `EndUserProbe` (`end_users`)
checking around each erasure that what it held is gone and that no other end user's leaks."""

from __future__ import annotations

import random
import threading
import time
import urllib.parse
from typing import Any

import httpx

from _fuzz.end_users import EndUserProbe


class EraseRacer(threading.Thread):
    """Erases one user every `period` s (one time in three twice at once) with the admin key while
    schemathesis runs as that user: every answer must be a receipt (200) whose verification holds
    no remnant; the receipts are verified again once the run is over (`remnants`).

    With `erase_key` (a frontend's key) the erasures go through that key, `user` being its end
    user: the per-user limit on erasure checks may answer `429 rate_limited` (documented, counted
    apart). With `probe`, each round plants a conversation first and reads it back after."""

    def __init__(
        self,
        base_url: str,
        admin_key: str,
        user: str,
        period: float,
        deadline: float,
        *,
        erase_key: str | None = None,
        probe: EndUserProbe | None = None,
    ) -> None:
        super().__init__(name="erase-racer", daemon=True)
        self.base_url, self.user, self.period = base_url, user, period
        self.headers = {"Authorization": f"Bearer {admin_key}"}  # receipts are re-read as the admin
        self.erase_headers = {"Authorization": f"Bearer {erase_key or admin_key}"}
        self.probe = probe
        self.deadline = deadline
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.receipts: list[str] = []
        self.answered: list[
            str | None
        ] = []  # this round's erasures answered 200: receipt ids (None: held nothing)
        self.counts: dict[str, int] = {
            "erasures": 0,
            "errors_5xx": 0,
            "hangs": 0,
            "other": 0,
            "rate_limited": 0,
        }
        self.remnants_at_erasure = 0
        self.findings: list[dict[str, Any]] = []

    def _count(self, key: str, finding: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if finding is not None and len(self.findings) < 20:
                self.findings.append(finding)

    def erase(self) -> None:
        path = "/v1/users/" + urllib.parse.quote(self.user, safe="")
        t0 = time.monotonic()
        try:
            r = httpx.delete(self.base_url + path, headers=self.erase_headers, timeout=self.deadline)
        except httpx.TimeoutException:
            self._count("hangs", {"request": f"DELETE {path}", "answer": f"none in {self.deadline:.0f} s"})
            return
        except httpx.HTTPError as exc:
            self._count("other", {"request": f"DELETE {path}", "answer": repr(exc)})
            return
        if r.status_code == 429 and self.erase_headers != self.headers:
            self._count("rate_limited")
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
            self.answered.append(None if held_nothing else receipt["id"])
            if not held_nothing:
                self.receipts.append(receipt["id"])
            self.remnants_at_erasure += bad
            if bad and len(self.findings) < 20:
                self.findings.append({"request": f"DELETE {path}", "took_s": round(time.monotonic() - t0, 2),
                                      "verification": ver})  # fmt: skip

    def run(self) -> None:
        rng = random.Random(7)
        if self.probe is not None:
            try:
                self.probe.setup()
            except (RuntimeError, httpx.HTTPError) as exc:
                self._count("other", {"request": "the probe's bystanders", "answer": repr(exc)})
                return
        while not self.stop.wait(self.period * rng.uniform(0.5, 1.5)):
            planted = self.probe.plant() if self.probe is not None else None
            k = 2 if rng.random() < 1 / 3 else 1
            with self.lock:
                self.answered = []
            threads = [threading.Thread(target=self.erase, daemon=True) for _ in range(k)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(self.deadline + 5)
            with self.lock:
                answered = list(self.answered)
            if self.probe is not None and answered:
                if planted is not None:
                    self.probe.check_gone(planted, answered[0])
                self.probe.check_bystanders()

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
