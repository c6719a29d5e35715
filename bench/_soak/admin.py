"""The soak's operator: the admin side racing the clients. Every `--race-erase-every-s` (+-50 %)
it erases one of the clients' users while that user's traffic runs (one time in three two or three
at once; some with the user's own key), recording each into the run's `ErasureLog` with the
verification its receipt answered; now and then it lists and re-reads receipts, creates, lists and
deletes public prefixes, reads health, the console and the models list."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import TYPE_CHECKING

import httpx

from .calls import Ambiguous, Caller, Stopped
from .model import ITEMS
from .server import user_path

if TYPE_CHECKING:
    from .controller import Controller


class Operator(Caller, threading.Thread):
    """The admin side, racing the clients: erasures of the users the traffic uses (now and then
    two or three of the same user at once, some with the user's own key), each receipt's
    verification read; the erasure list, public prefixes (create, list, delete), health, the
    console's files, the models list."""

    def __init__(self, ctl: Controller, seed: int, users: dict[str, str]) -> None:
        threading.Thread.__init__(self, name="soak-operator", daemon=True)
        Caller.__init__(self, ctl)
        self.rng = random.Random(f"{seed}-operator")
        self.users = users  # user -> key
        self.http = self.http_client(ctl.admin_key)
        self.prefixes: list[str] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            next_erase = self.rng.uniform(0.5, 1.5) * self.ctl.race_erase_every_s
            t = 0.0
            while not self.gate.stop.is_set():
                time.sleep(1.0)
                if not self.gate.is_open:
                    continue
                t += 1.0
                with self.gate.step(), contextlib.suppress(Ambiguous):
                    if t >= next_erase and self.users:
                        next_erase = t + self.rng.uniform(0.5, 1.5) * self.ctl.race_erase_every_s
                        self.erase_race()
                    elif self.rng.random() < 0.2:
                        self.admin_op()
        except Stopped:
            pass
        except BaseException as exc:
            import traceback

            self.error = exc
            self.rec.event("client_crash", user="operator", error=traceback.format_exc())
            self.rec.count("unexpected")

    def erase_race(self) -> None:
        user = self.rng.choice(sorted(self.users))
        k = self.rng.choices([1, 2, 3], [6, 3, 1])[0]
        threads = [
            threading.Thread(target=self.erase_one, args=(user, self.rng.random() < 0.3, k), daemon=True)
            for _ in range(k)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(self.ctl.deadline_s * 2 + 10)
        self.rec.count(f"race_erasures_x{k}")

    def erase_one(self, user: str, own_key: bool, together: int) -> None:
        """One DELETE /v1/users/{user}; the receipt's verification at once (`remnants_at_erasure`)."""
        er = self.ctl.erasures.begin(user, "user" if own_key else "admin", together)
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        key = self.users[user] if own_key else self.ctl.admin_key
        try:
            with self.http_client(key) as c:
                r = c.delete(user_path(user))
        except httpx.TimeoutException as exc:
            self.ctl.erasures.end(er, None, unknown=True)
            with self.lock, contextlib.suppress(Exception):
                self.no_answer("race_erase", gen0, t0, exc, timeout=True)
            return
        except httpx.TransportError as exc:
            self.ctl.erasures.end(er, None)
            with self.lock, contextlib.suppress(Exception):
                self.no_answer("race_erase", gen0, t0, exc, timeout=False)
            return
        with self.lock:
            self.check_time("race_erase", t0)
            if r.status_code != 200:
                self.ctl.erasures.end(er, None, void=r.status_code < 500)
                self.rec.event(
                    "race_erase_answer", user=user, by=er.by, together=together, status=r.status_code
                )
                with contextlib.suppress(Ambiguous):
                    self.check_status("race_erase", r.status_code, r.text, (200,))
                return
        receipt = r.json()
        self.ctl.erasures.end(er, receipt)
        self.rec.count("erasures")
        self.rec.count("race_erasures")

    def admin_op(self) -> None:
        op = self.rng.choice(["erasures", "receipt", "prefix", "prefix", "health", "console", "models"])
        if op == "erasures":
            body = self.req("erasure_list", "GET", "/v1/erasures?limit=5").json()
            if body.get("data") and self.rng.random() < 0.5:
                self.req("erasure_list", "GET", f"/v1/erasures?limit=5&after={body['data'][-1]['id']}")
        elif op == "receipt":
            rid = self.ctl.erasures.some_receipt(self.rng)
            if rid is not None:
                self.req("receipt", "GET", f"/v1/erasures/{rid}")
        elif op == "prefix":
            if len(self.prefixes) < 2 or self.rng.random() < 0.5:
                # A text prefix: no chat prompt starts with its tokens, so a prefix of the
                # template (`<|im_start|>system`) never shows as cached in an erasure's checks.
                text = "Soak museum front desk. " + " ".join(
                    f"Room {i} shows {self.rng.choice(ITEMS)} from {1700 + 7 * i}." for i in range(40)
                )
                body = {"text": text, "pin": self.rng.random() < 0.25}
                pid = self.req("prefix_create", "POST", "/v1/prefixes", body, expect=(201,)).json()["id"]
                self.prefixes.append(pid)
            else:
                pid = self.prefixes.pop(0)
                self.req("prefix_delete", "DELETE", f"/v1/prefixes/{pid}", expect=(200, 404))
            self.req("prefix_list", "GET", "/v1/prefixes")
        elif op == "health":
            self.req("health", "GET", "/healthz")
            self.req("health", "GET", "/readyz")
        elif op == "console":
            self.req("console", "GET", "/console")
            self.req("console", "GET", "/console/", expect=(200, 307))
            self.req("console", "GET", f"/console/{self.rng.choice(['app.js', 'style.css', 'index.html'])}")
        else:
            self.req("models", "GET", "/v1/models")
