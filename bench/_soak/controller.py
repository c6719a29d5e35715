"""The soak's controller: creates the API keys (one user per client, an admin, a replay user),
starts `dss serve`, runs the clients and the operator for `--duration-s` seconds of traffic,
SIGKILLs the server every `--kill-every-s` (+-20 %) and restarts it on the same data directory,
and checks the ledgers after each restart and at the end (`Verifier`), with the traffic paused:
the gate is closed and every step in flight has ended before a kill's restart is checked or the
final checks run. The verdict is `report.report`'s."""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

from _procs import free_port

from .admin import Operator
from .calls import Gate, Recorder
from .client import Client
from .end_users import END_USER_NAMES, FRONTEND, SESSION_HEADER, USER_HEADER, EndUsers
from .erasures import ErasureLog
from .report import RunEnd, report
from .server import Server, create_frontend_key, create_key, try_create_key
from .verify import Verifier

ODD_USER = "soak@org/user-1"  # client 1's user id with --odd-user-id


class Controller:
    frontend_key: str  # with --end-users

    def __init__(self, args: argparse.Namespace, out: Path, data_dir: Path) -> None:
        self.args = args
        self.out = out
        self.data_dir = data_dir
        self.deadline_s = float(args.deadline_s)
        self.replay_fraction = float(args.replay_fraction)
        self.erase_weight = float(args.erase_weight)
        self.alt_seed = bool(args.alt_seed)
        self.race_erase_every_s = float(args.race_erase_every_s)
        self.gate = Gate()
        self.rec = Recorder(out / "events.jsonl")
        self.erasures = ErasureLog(self.rec)
        self.verifier = Verifier(self.rec, self.erasures, data_dir)
        self.restart_failures = 0
        t0 = time.monotonic()
        self.admin_key = create_key(data_dir, None)
        self.replay_key = create_key(data_dir, "soak-replay")
        users, keys = [], []
        for i in range(args.clients):
            user, key = f"soak-user-{i}", None
            if i == 1 and args.odd_user_id:
                # A user id with a slash and an at sign (issue 19, item 1): every id the server
                # accepts must be erasable; where `dss keys create` refuses it, a plain one.
                key = try_create_key(data_dir, ODD_USER)
                user = ODD_USER if key is not None else user
                print(
                    f"user id {ODD_USER!r}: {'accepted' if key else 'refused by dss keys create'}", flush=True
                )
            users.append(user)
            keys.append(key or create_key(data_dir, user))
        n_end_users = min(int(args.end_users), len(END_USER_NAMES))
        if n_end_users:
            self.frontend_key = create_frontend_key(data_dir, FRONTEND, USER_HEADER, SESSION_HEADER)
        print(
            f"created {len(keys) + 2 + bool(n_end_users)} API keys in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        port = args.port or free_port()
        self.server = Server(data_dir, port, out / "server.log", self.admin_key)
        self.clients = [
            Client(i, u, k, self, args.seed) for i, (u, k) in enumerate(zip(users, keys, strict=True))
        ]
        racing = dict(zip(users, keys, strict=True)) if self.race_erase_every_s > 0 else {}
        self.operator = Operator(self, args.seed, racing)
        # One frontend key acting for a few end users, racing erasures of its own (`end_users`).
        self.end_users = EndUsers(self, args.seed, END_USER_NAMES[:n_end_users]) if n_end_users else None

    def pause(self) -> None:
        if not self.gate.close(self.deadline_s * 3 + 30):
            self.rec.count("hangs")
            self.rec.event("pause_timeout", inflight=self.gate.inflight)
            self.gate.close(600)

    def kill_and_restart(self) -> bool:
        self.server.scrape()
        with self.gate.cond:
            self.gate.is_open = False
            self.gate.down = True
            self.gate.gen += 1
        t0 = time.monotonic()
        self.server.kill()
        self.pause()
        try:
            self.server.start()
        except RuntimeError as exc:
            self.restart_failures += 1
            self.rec.event("restart_failed", error=str(exc), log=self.log_tail())
            print(f"restart failed: {exc}", flush=True)
            return False
        self.gate.down = False
        for c in self.clients:
            c.resolve()
        phase = f"after restart {self.server.starts - 1}"
        checked = self.verifier.verify_ledgers(self.clients, phase)
        if self.end_users is not None:
            self.end_users.resolve()
            checked += self.end_users.checks.verify(phase)
        self.rec.count("restarts")
        print(
            f"  restart #{self.server.starts - 1}: down {time.monotonic() - t0:.0f} s "
            f"(ready in {self.server.start_seconds[-1]:.0f} s), {checked} versions checked",
            flush=True,
        )
        return True

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.server.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def progress(self, run_s: float) -> None:
        c = self.rec.counts
        print(
            f"[{run_s:6.0f} s] requests={c['requests']} acked={c['acked_versions']} "
            f"interrupted={c['interrupted']} 5xx={c['errors_5xx']} hangs={c['hangs']} "
            f"lost={c['lost_versions']} unexpected={c['unexpected']} erasures={c['erasures']} "
            f"erased_4xx={c['erased_4xx']} "
            f"greedy={c['greedy_mismatch']}/{c['greedy_checked']} restarts={c['restarts']}",
            flush=True,
        )

    def run(self) -> int:
        args = self.args
        rng = random.Random(f"{args.seed}-kills")
        t_start = time.monotonic()
        print(f"starting the server on port {self.server.port} (data {self.data_dir})", flush=True)
        self.server.start()
        print(f"ready in {self.server.start_seconds[-1]:.0f} s; {args.clients} clients", flush=True)
        for c in self.clients:
            c.start()
        self.operator.start()
        if self.end_users is not None:
            self.end_users.start()
        self.gate.open()
        run_s, kills = 0.0, 0
        next_kill = args.kill_every_s * rng.uniform(0.8, 1.2) if args.kill_every_s > 0 else float("inf")
        last_scrape = last_print = 0.0
        while run_s < args.duration_s:
            time.sleep(1.0)
            run_s += 1.0
            if run_s - last_scrape >= 5:
                self.server.scrape()
                last_scrape = run_s
            if run_s - last_print >= 30:
                self.progress(run_s)
                last_print = run_s
            can_kill = args.max_kills < 0 or kills < args.max_kills
            if can_kill and run_s >= next_kill and run_s < args.duration_s - 5:
                kills += 1
                if not self.kill_and_restart():
                    break
                self.gate.open()
                next_kill = run_s + args.kill_every_s * rng.uniform(0.8, 1.2)
        # --------------------------------------------------------------------- final checks
        self.pause()
        self.gate.stop.set()
        threads: list[threading.Thread] = [*self.clients, self.operator]
        for th in threads + ([self.end_users] if self.end_users is not None else []):
            th.join(30)
        final_checked = receipts_bad = erased_hits = deleted_hits = 0
        if self.server.proc is not None:
            self.server.scrape()
            for c in self.clients:
                c.resolve()
            final_checked = self.verifier.verify_ledgers(self.clients, "final")
            if self.end_users is not None:
                self.end_users.resolve()
                final_checked += self.end_users.checks.verify("final")
            receipts_bad = self.verifier.reverify_receipts(self.operator.http)
            erased_hits, deleted_hits = self.verifier.db_scan(self.clients)
            if self.end_users is not None:
                erased_hits += self.verifier.end_user_db_scan(self.end_users.users)
        stop_rc, stop_s = self.server.stop()
        end = RunEnd(
            final_checked=final_checked,
            receipts_bad=receipts_bad,
            erased_hits=erased_hits,
            deleted_hits=deleted_hits,
            restart_failures=self.restart_failures,
            verified=self.verifier.verified,
            stop_rc=stop_rc,
            stop_s=stop_s,
            wall_s=time.monotonic() - t_start,
        )
        return report(self.out, self.rec, self.server, end)
