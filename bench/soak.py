"""Soak and fault campaign: the real `dss serve` under mixed traffic, SIGKILLed and restarted.

What it does (docs/operations.md, "Soak and fault campaign", says how to read the result):

- creates API keys (`dss keys create`) for one user per client, one admin and one replay user in
  a fresh data directory, then starts `dss serve` as a subprocess in its own process group, with
  small tiers (host arena 64 MiB, disk 256 MiB, vLLM KV cache 1 GiB) so that eviction runs;
- runs `--clients` threads for `--duration-s` seconds of traffic (time spent restarting does not
  count), each as its own user, mixing: chat turns with `session_id` through the official `openai`
  client (streamed and not, greedy, a few tokens), stateful `/messages` turns (streamed and not),
  explicit session creation, rollbacks, branches, session deletes, erasure of the client's own
  user with the admin key (the user then goes on with fresh sessions, reusing the erased ids), and
  streams the client drops after two chunks; every request has a client deadline
  (`--deadline-s`): one that passes it is a hang;
- every `--kill-every-s` seconds of traffic (+-20 %) sends SIGKILL to the whole process group (the
  API process and the engine's children), restarts the server on the same data directory and
  waits for `/readyz`;
- keeps a client-side ledger of every version the server acknowledged (session, number, parent,
  branch, the messages as sent plus the answer as returned), minus what the client itself deleted
  (session delete, user erasure). Rollbacks remove nothing: rolled-back versions stay listed
  (docs/api.md). After each restart and at the end, with the traffic paused, every ledger entry is
  checked through `GET /v1/sessions/{sid}/versions` and `GET .../versions/{n}`: a *lost version* is
  one the server no longer lists, or lists with another parent, branch or messages;
- counts requests, 5xx answers, hangs, restarts; requests cut by a kill are `interrupted` (their
  outcome is unknown: the client re-reads the session, retries a delete or an erasure, and never
  adds an unacknowledged version to the ledger);
- `corrupt_served`: `dss_corrupt_pages_total` from `/metrics`, summed over server incarnations
  (scraped every few seconds and just before each kill) - pages whose checksum or authentication
  failed on their way to the engine; the server refuses them, but any at all means the store
  corrupted something (no bytes are corrupted on purpose here);
- `greedy_mismatch`: a sample of non-streamed session turns is replayed by another user (its own
  cache namespace, so a cold prefill) as a plain request with the same messages, greedy, and the
  texts compared. On this CPU bf16 build a few percent of turns differ from a cold prefill whatever
  the cache did (batch composition changes the rounding), so this is reported, not failed;
- `remnants`: each erasure receipt's verification (at the erasure and again at the end, `GET
  /v1/erasures/{id}`), sessions still listed after an erasure, a replay of an erased prompt that
  still reports cached tokens, and a byte scan of the SQLite files (`dss.sqlite3`, `-wal`) for the
  marker strings of every erased session's messages. The disk tier and the host arena hold KV
  tensors (on disk compressed and AES-GCM encrypted), not text, so a byte scan for the markers
  would say nothing there: the receipt verification covers them (page table, page files).

The last line is `RESULT requests= hangs= errors_5xx= lost_versions= corrupt_served= remnants=
restarts= ...`; the exit status is 1 when any of hangs, errors_5xx, lost_versions, corrupt_served,
remnants, unexpected (a connection error no kill explains, an answer that a valid request should
not get) or restart_failures is not 0. `--out` keeps summary.json, events.jsonl and server.log.

    .venv/bin/python bench/soak.py --duration-s 1200 --kill-every-s 180 --clients 4 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import die_with_parent, free_port, model_dir

REPO = Path(__file__).resolve().parents[1]
# The code the server runs: the checkout, or (`--server-root`) another copy of it, e.g. a
# `git archive` of a commit, imported first through PYTHONPATH (the venv's editable install of the
# checkout comes after it on the import path).
SERVER_ROOT = REPO
MIB = 1 << 20
START_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 90.0
MAX_SESSIONS = 3  # per client
MAX_DEPTH = 13  # messages in a version before a client stops extending it
MAX_BRANCHES = 6  # per session
FAIL_KEYS = ("hangs", "errors_5xx", "lost_versions", "corrupt_served", "remnants", "unexpected")

QUESTIONS = [
    "Which shelf holds the oldest item?",
    "Name one item from the list.",
    "What is on shelf 3?",
    "Summarise the room in five words.",
    "Which year appears most often?",
    "Is there anything made of brass?",
    "What should a visitor see first?",
    "Answer with one word: big or small?",
    "Count the shelves you know about.",
    "Which item would you lend out?",
    "Repeat the session code.",
    "What did I ask before?",
]
ITEMS = [
    "a brass compass", "an oak chest", "a glass lantern", "a silver spoon", "a wool blanket",
    "a copper kettle", "a paper map", "a tin soldier", "a clay pot", "a leather boot",
    "an iron key", "a linen shirt", "a bone comb", "a stone axe", "a cork float",
]  # fmt: skip


# ---------------------------------------------------------------------------------- utilities


def dss_cli() -> list[str]:
    script = Path(sys.executable).with_name("dss")
    return [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]


def code_env() -> dict[str, str]:
    env = dict(os.environ)
    if SERVER_ROOT != REPO:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SERVER_ROOT), env.get("PYTHONPATH")]))
    return env


def create_key(data_dir: Path, user: str | None) -> str:
    """`dss keys create --user NAME` / `--admin`: the key is the last line of its stdout."""
    cmd = [*dss_cli(), "keys", "create", "--data-dir", str(data_dir)]
    cmd += ["--admin"] if user is None else ["--user", user]
    proc = subprocess.run(
        cmd, cwd=SERVER_ROOT, env=code_env(), capture_output=True, text=True, timeout=120, check=False
    )
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return lines[-1]


def parse_metrics(text: str) -> dict[str, float]:
    """The few counters the soak reads, from the Prometheus text format."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name in (
            "dss_corrupt_pages_total",
            "dss_connector_store_errors_total",
            "dss_disk_write_errors_total",
            "dss_generations_aborted_total",
            "dss_versions_committed_total",
        ):
            out[name] += v
        elif name == "dss_http_requests_total" and re.search(r'status="5\d\d"', labels):
            route = re.search(r'route="([^"]*)"', labels)
            status = re.search(r'status="(\d+)"', labels)
            where = f"{route.group(1) if route else '?'} {status.group(1) if status else '?'}"
            out[f"5xx by route: {where}"] += v
            # /readyz answers 503 by design while the engine starts (the soak polls it then).
            if route is None or route.group(1) not in ("/readyz", "/healthz"):
                out["server_5xx"] += v
        elif name == "dss_evictions_total":
            out["evictions"] += v
    return dict(out)


class Stopped(Exception):
    """The run is over; the client thread leaves."""


class Ambiguous(Exception):
    """A request whose outcome the client does not know (cut by a kill, 5xx, hang, odd answer)."""


# ------------------------------------------------------------------------------------ server
class Server:
    """`dss serve` in its own process group; SIGKILL takes the group (API and engine) at once."""

    def __init__(self, data_dir: Path, port: int, log_path: Path, admin_key: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.admin_key = admin_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.last_metrics: dict[str, float] = {}
        self.metrics_total: Counter[str] = Counter()
        self.start_seconds: list[float] = []

    def env(self) -> dict[str, str]:
        env = code_env()
        env.update(
            {
                "DSS_STORE__HOST_CAPACITY_BYTES": str(64 * MIB),
                "DSS_STORE__DISK_CAPACITY_BYTES": str(256 * MIB),
                "DSS_ENGINE__KV_CACHE_SPACE_GIB": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "DSS_ENGINE__MAX_MODEL_LEN": "2048",
                "DSS_LIMITS__MAX_OUTPUT_TOKENS": "128",
                "DSS_LIMITS__DEFAULT_MAX_TOKENS": "16",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def start(self) -> None:
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(
                f"\n===== soak: start #{self.starts + 1} at {time.strftime('%H:%M:%S')} =====\n".encode()
            )
            cmd = [
                *dss_cli(), "serve",
                "--model", str(model_dir()),
                "--data-dir", str(self.data_dir),
                "--host", "127.0.0.1",
                "--port", str(self.port),
                "--log-level", "warning",
            ]  # fmt: skip
            self.proc = subprocess.Popen(
                cmd,
                cwd=SERVER_ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: os.killpg reaches the engine too
                preexec_fn=die_with_parent,
            )
        self.starts += 1
        self.last_metrics = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up ({self.proc.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/readyz", timeout=3).status_code == 200:
                    self.start_seconds.append(time.monotonic() - t0)
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {START_TIMEOUT_S:.0f} s")

    def scrape(self) -> dict[str, float] | None:
        try:
            r = httpx.get(
                self.base_url + "/metrics", headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        self.last_metrics = parse_metrics(r.text)
        return self.last_metrics

    def _bank_metrics(self) -> None:
        """Counters restart from 0 with each process: keep the last scrape of the one ending."""
        self.metrics_total.update(self.last_metrics)
        self.last_metrics = {}

    def _group_alive(self, pgid: int) -> bool:
        import psutil

        for p in psutil.process_iter(["status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
        return False

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self._bank_metrics()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 60
        while self._group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> tuple[int | None, float]:
        """Graceful stop (SIGTERM to the API process); SIGKILL the group if it does not end."""
        proc = self.proc
        if proc is None:
            return None, 0.0
        self._bank_metrics()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        self.proc = proc
        self.kill()
        return rc, took


# ---------------------------------------------------------------------------------- the gate
class Gate:
    """Clients run steps only while the gate is open; the controller closes it (and waits for the
    steps in flight) to restart the server or to check the ledger."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.is_open = False
        self.inflight = 0
        self.down = False  # the server is being killed / restarted
        self.gen = 0  # bumped at every kill
        self.stop = threading.Event()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self.cond:
            while not self.is_open:
                if self.stop.is_set():
                    raise Stopped
                self.cond.wait(0.5)
            self.inflight += 1
        try:
            yield
        finally:
            with self.cond:
                self.inflight -= 1
                self.cond.notify_all()

    def close(self, timeout: float) -> bool:
        with self.cond:
            self.is_open = False
            end = time.monotonic() + timeout
            while self.inflight > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def open(self) -> None:
        with self.cond:
            self.is_open = True
            self.cond.notify_all()


# --------------------------------------------------------------------------------- recording
class Recorder:
    def __init__(self, path: Path) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.path = path
        self.examples: dict[str, list[dict[str, Any]]] = {}
        self.latencies: dict[str, list[float]] = {}

    def latency(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)

    def latency_summary(self) -> dict[str, dict[str, float]]:
        out = {}
        with self.lock:
            for kind, xs in sorted(self.latencies.items()):
                xs = sorted(xs)
                out[kind] = {
                    "n": len(xs),
                    "p50": round(xs[len(xs) // 2], 3),
                    "p99": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
                    "max": round(xs[-1], 3),
                }
        return out

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def event(self, kind: str, keep: int = 20, **info: Any) -> None:
        rec = {"t": time.strftime("%H:%M:%S"), "kind": kind, **info}
        line = json.dumps(rec, default=str)
        with self.lock:
            ex = self.examples.setdefault(kind, [])
            if len(ex) < keep:
                ex.append(rec)
            with open(self.path, "a") as f:
                f.write(line + "\n")


# ----------------------------------------------------------------------------------- clients
Messages = list[dict[str, Any]]


@dataclass
class Sess:
    sid: str
    marker: str
    system: str
    stored_system: bool  # created by POST /v1/sessions with the system prompt
    branches: dict[str, int] = field(default_factory=lambda: {"main": 0})
    known: dict[int, Messages] = field(default_factory=dict)  # acknowledged or read back
    parents: dict[int, int | None] = field(default_factory=dict)
    vcount: int = 0
    dirty: bool = False  # its state is uncertain: re-read it before the next step
    n_branches: int = 0

    def root(self) -> Messages:
        return [{"role": "system", "content": self.system}]

    def base(self, head: int) -> Messages:
        return self.root() if head == 0 else self.known[head]


@dataclass
class Entry:
    sid: str
    number: int
    parent: int | None
    branch: str
    messages: Messages
    via: str


class Client(threading.Thread):
    def __init__(
        self,
        idx: int,
        user: str,
        key: str,
        ctl: Controller,
        seed: int,
    ) -> None:
        super().__init__(name=f"soak-client-{idx}", daemon=True)
        self.idx, self.user, self.key, self.ctl = idx, user, key, ctl
        self.gate, self.rec = ctl.gate, ctl.rec
        self.rng = random.Random(f"{seed}-{idx}")
        base, deadline = ctl.server.base_url, ctl.deadline_s
        timeout = httpx.Timeout(deadline, connect=10.0)
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
        self.admin = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {ctl.admin_key}"}, timeout=timeout
        )
        self.replay = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {ctl.replay_key}"}, timeout=timeout
        )
        import openai

        self.oa = openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=deadline, max_retries=0)
        self.epoch = 0
        self.next_sid = 0
        self.counter = 0
        self.sessions: dict[str, Sess] = {}
        self.ledger: dict[tuple[str, int], Entry] = {}
        self.pending_delete: set[str] = set()
        self.pending_erase = False
        self.erased_markers: list[str] = []
        self.deleted_markers: list[str] = []
        self.epoch_markers: list[str] = []
        self.receipts: list[str] = []
        self.error: BaseException | None = None

    # ----------------------------------------------------------------------------- plumbing
    def run(self) -> None:
        try:
            while not self.gate.stop.is_set():
                with self.gate.step():
                    self.step()
        except Stopped:
            pass
        except BaseException as exc:  # a bug in the soak itself: report it, do not hide it
            import traceback

            self.error = exc
            self.rec.event("client_crash", user=self.user, error=traceback.format_exc())
            self.rec.count("unexpected")

    def _outcome(self, kind: str, gen0: int, t0: float, exc: BaseException, timeout: bool) -> Ambiguous:
        """Classify a request that got no answer."""
        took = time.monotonic() - t0
        if self.gate.down or self.gate.gen != gen0:
            self.rec.count("interrupted")
            return Ambiguous(f"{kind}: cut by a kill")
        if timeout:
            self.rec.count("hangs")
            self.rec.event("hang", user=self.user, op=kind, seconds=round(took, 1), error=repr(exc))
        else:
            self.rec.count("unexpected")
            self.rec.event("connection_error", user=self.user, op=kind, error=repr(exc))
        return Ambiguous(f"{kind}: {exc!r}")

    def _check_time(self, kind: str, t0: float) -> None:
        took = time.monotonic() - t0
        self.rec.latency(kind, took)
        if took > self.ctl.deadline_s:
            self.rec.count("hangs")
            self.rec.event("hang", user=self.user, op=kind, seconds=round(took, 1), note="answered late")

    def _status(self, kind: str, status: int, body: str, expect: tuple[int, ...]) -> None:
        if status in expect:
            return
        if status >= 500:
            self.rec.count("errors_5xx")
            self.rec.event("5xx", user=self.user, op=kind, status=status, body=body[:2000])
        else:
            self.rec.count("unexpected")
            self.rec.event("unexpected_status", user=self.user, op=kind, status=status, body=body[:2000])
        raise Ambiguous(f"{kind}: {status}")

    def req(
        self,
        kind: str,
        method: str,
        path: str,
        body: Any = None,
        expect: tuple[int, ...] = (200,),
        client: httpx.Client | None = None,
    ) -> httpx.Response:
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        try:
            r = (client or self.http).request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=False) from None
        self._check_time(kind, t0)
        self._status(kind, r.status_code, r.text, expect)
        return r

    def openai_call(self, kind: str, fn: Callable[[], Any]) -> Any:
        import openai

        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        try:
            out = fn()
        except (openai.APITimeoutError, httpx.TimeoutException) as exc:  # httpx's: inside a stream
            raise self._outcome(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=False) from None
        except openai.APIConnectionError as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=False) from None
        except openai.APIStatusError as exc:
            self._status(kind, exc.status_code, exc.response.text, ())
            raise  # unreachable: _status raised
        except openai.APIError as exc:  # an error event inside a stream
            if self.gate.down or self.gate.gen != gen0:
                self.rec.count("interrupted")
            else:
                self.rec.count("unexpected")
                self.rec.event("stream_error", user=self.user, op=kind, error=repr(exc), body=exc.body)
            raise Ambiguous(kind) from None
        self._check_time(kind, t0)
        return out

    def marker(self) -> str:
        return f"zqk{self.idx}e{self.epoch}x{self.rng.getrandbits(40):010x}"

    def user_text(self, s: Sess) -> str:
        self.counter += 1
        return f"[{s.marker}] #{self.counter} {self.rng.choice(QUESTIONS)}"

    def new_session(self, stored: bool) -> Sess:
        sid = f"soak-u{self.idx}-s{self.next_sid}"
        self.next_sid += 1
        marker = self.marker()
        self.epoch_markers.append(marker)
        facts = " ".join(
            f"Shelf {k} of room {marker} holds {self.rng.choice(ITEMS)} from {self.rng.randint(1700, 1990)}."
            for k in range(self.rng.randint(12, 30))
        )
        system = f"You are the archivist of room {marker}. Answer briefly. {facts}"
        s = Sess(sid, marker, system, stored)
        self.sessions[sid] = s
        return s

    def acked(self, s: Sess, data: dict[str, Any], messages: Messages, via: str, expect_parent: int) -> None:
        """The server acknowledged a committed version: into the ledger."""
        number, parent, branch = data.get("state_version"), data.get("parent_version"), data.get("branch")
        if not isinstance(number, int) or not isinstance(branch, str):
            self.rec.count("unexpected")
            self.rec.event("ack_without_version", user=self.user, op=via, data=str(data)[:1000])
            s.dirty = True
            return
        old = self.ledger.get((s.sid, number))
        if old is not None:  # the number was given out twice: the first version is gone
            self.ctl.lost(self, old, "its number was given to another version", {"new": messages})
        if (parent or 0) != expect_parent:
            self.rec.count("other_parent")
        self.ledger[(s.sid, number)] = Entry(s.sid, number, parent, branch, messages, via)
        self.rec.count("acked_versions")
        s.known[number] = messages
        s.parents[number] = parent
        s.branches[branch] = number
        s.vcount = max(s.vcount, number)

    # ---------------------------------------------------------------------------- the steps
    def step(self) -> None:
        try:
            if self.pending_erase:
                self.erase()
                return
            for sid in list(self.pending_delete):
                self.delete(sid)
            for s in [s for s in self.sessions.values() if s.dirty]:
                self.resync(s)
            self.random_op()
        except Ambiguous:
            pass

    def resolve(self) -> None:
        """After a restart (called by the controller while this client is paused)."""
        for _ in range(3):
            try:
                if self.pending_erase:
                    self.erase()
                for sid in list(self.pending_delete):
                    self.delete(sid)
                for s in list(self.sessions.values()):
                    self.resync(s)
                return
            except Ambiguous:
                continue

    def random_op(self) -> None:
        r = self.rng
        ops: list[tuple[str, float]] = [
            ("chat", 24),
            ("chat_stream", 14),
            ("message", 18),
            ("rollback", 8),
            ("branch", 7),
            ("disconnect", 6),
            ("read", 6),
            ("create", 3),
            ("delete", 3),
            ("erase", self.ctl.erase_weight),
        ]
        op = r.choices([o for o, _ in ops], [w for _, w in ops])[0]
        self.rec.count(f"op_{op}")
        if op in ("chat", "chat_stream", "message", "disconnect"):
            self.turn(op)
        elif op == "create":
            if len(self.sessions) < MAX_SESSIONS:
                self.create()
            else:
                self.turn("chat")
        else:
            {"rollback": self.rollback, "branch": self.branch, "read": self.read,
             "delete": self.delete_random, "erase": self.erase}[op]()  # fmt: skip

    def pick(self) -> tuple[Sess, str, int] | None:
        options = [
            (s, b, h)
            for s in self.sessions.values()
            for b, h in s.branches.items()
            if (h == 0 or h in s.known) and len(s.base(h)) < MAX_DEPTH
        ]
        if not options:
            return None
        return self.rng.choice(options)

    def turn(self, op: str) -> None:
        picked = self.pick()
        if picked is None or (len(self.sessions) < MAX_SESSIONS and self.rng.random() < 0.12):
            if len(self.sessions) >= MAX_SESSIONS:
                self.rollback()
                return
            s = self.new_session(stored=False)
            picked = (s, "main", 0)
        s, branch, head = picked
        if op == "message" and head == 0 and not s.stored_system:
            op = "chat"
        if op == "chat":
            self.chat(s, head, stream=False)
        elif op == "chat_stream":
            self.chat(s, head, stream=True)
        elif op == "message":
            self.message(s, branch, head, stream=self.rng.random() < 0.4)
        else:
            self.disconnect(s, branch, head)

    def chat(self, s: Sess, head: int, stream: bool) -> None:
        sent = [*s.base(head), {"role": "user", "content": self.user_text(s)}]
        max_tokens = self.rng.choice([6, 8, 12, 16])
        kind = "chat_stream" if stream else "chat"
        s.dirty = True  # until acknowledged
        if not stream:
            resp = self.openai_call(
                kind,
                lambda: self.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"session_id": s.sid},
                ),
            )
            text = resp.choices[0].message.content or ""
            data = dict(resp.model_extra or {})
        else:

            def consume() -> tuple[str, dict[str, Any]]:
                parts: list[str] = []
                fields: dict[str, Any] = {}
                for chunk in self.oa.chat.completions.create(
                    model="default",
                    messages=sent,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"session_id": s.sid},
                ):
                    extra = chunk.model_extra or {}
                    if extra.get("state_version") is not None:
                        fields = dict(extra)
                    if chunk.choices and chunk.choices[0].delta.content:
                        parts.append(chunk.choices[0].delta.content)
                return "".join(parts), fields

            text, data = self.openai_call(kind, consume)
        messages = [*sent, {"role": "assistant", "content": text}]
        self.acked(s, data, messages, kind, head)
        s.dirty = False
        if not stream and self.rng.random() < self.ctl.replay_fraction:
            self.greedy_replay(sent, max_tokens, text, data)

    def greedy_replay(self, sent: Messages, max_tokens: int, text: str, data: dict[str, Any]) -> None:
        """The same messages as a plain request of another user (a cold prefill): same text?"""
        body = {"model": "default", "messages": sent, "max_tokens": max_tokens, "temperature": 0}
        r = self.req("replay", "POST", "/v1/chat/completions", body, client=self.replay)
        other = r.json()["choices"][0]["message"]["content"]
        dss = data.get("dss") or {}
        loaded = int(dss.get("loaded_tokens") or 0)  # read from a DSS tier by the connector
        cached = int(dss.get("cached_tokens") or 0)  # not computed: DSS or vLLM's own prefix cache
        self.rec.count("greedy_checked")
        self.rec.count("greedy_checked_cached", 1 if cached else 0)
        self.rec.count("greedy_checked_loaded", 1 if loaded else 0)
        if other != text:
            self.rec.count("greedy_mismatch")
            self.rec.count("greedy_mismatch_cached", 1 if cached else 0)
            self.rec.count("greedy_mismatch_loaded", 1 if loaded else 0)
            self.rec.event("greedy_mismatch", keep=10, session=text, cold=other, dss=dss)

    def _sse(self, resp: httpx.Response) -> Iterator[dict[str, Any] | str]:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                yield payload if payload == "[DONE]" else json.loads(payload)

    def message(self, s: Sess, branch: str, head: int, stream: bool) -> None:
        content = self.user_text(s)
        body = {
            "content": content,
            "branch": branch,
            "max_tokens": self.rng.choice([6, 8, 12]),
            "temperature": 0,
            "stream": stream,
        }
        path = f"/v1/sessions/{s.sid}/messages"
        s.dirty = True
        if not stream:
            data = self.req("message", "POST", path, body).json()
            text = data["choices"][0]["message"]["content"]
        else:
            text, data = self.stream_request("message_stream", path, body)
        parent = data.get("parent_version")
        if parent is not None and parent not in s.known:
            self.resync(s)  # the client did not know that version: read it back
        base = s.root() if parent is None else s.known.get(parent)
        if base is None:
            self.rec.count("unexpected")
            self.rec.event("unknown_parent", user=self.user, session=s.sid, data=str(data)[:500])
            return
        if data.get("branch") != branch:
            self.rec.count("unexpected")
            self.rec.event("message_wrong_branch", user=self.user, asked=branch, got=data.get("branch"))
        messages = [*base, {"role": "user", "content": content}, {"role": "assistant", "content": text}]
        self.acked(s, data, messages, "message_stream" if stream else "message", head)
        s.dirty = False

    def stream_request(self, kind: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        parts: list[str] = []
        fields: dict[str, Any] = {}
        done = False
        try:
            with self.http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._status(kind, resp.status_code, resp.text, (200,))
                for ev in self._sse(resp):
                    if ev == "[DONE]":
                        done = True
                        break
                    assert isinstance(ev, dict)
                    if "error" in ev:
                        if self.gate.down or self.gate.gen != gen0:
                            self.rec.count("interrupted")
                        else:
                            self.rec.count("unexpected")
                            self.rec.event("stream_error", user=self.user, op=kind, error=ev["error"])
                        raise Ambiguous(kind)
                    if ev.get("state_version") is not None:
                        fields = ev
                    for ch in ev.get("choices") or []:
                        parts.append((ch.get("delta") or {}).get("content") or "")
        except httpx.TimeoutException as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self._outcome(kind, gen0, t0, exc, timeout=False) from None
        self._check_time(kind, t0)
        if not done:
            raise self._outcome(kind, gen0, t0, RuntimeError("stream ended without [DONE]"), timeout=False)
        return "".join(parts), fields

    def disconnect(self, s: Sess, branch: str, head: int) -> None:
        """A stream the client drops after two content chunks: nothing should be committed."""
        before = s.vcount
        if head > 0 and self.rng.random() < 0.5:
            path = f"/v1/sessions/{s.sid}/messages"
            body: dict[str, Any] = {"content": self.user_text(s), "branch": branch, "stream": True}
        else:
            path = "/v1/chat/completions"
            sent = [*s.base(head), {"role": "user", "content": self.user_text(s)}]
            body = {"messages": sent, "session_id": s.sid, "stream": True}
        body.update({"max_tokens": 96, "temperature": 0})
        gen0, t0 = self.gate.gen, time.monotonic()
        self.rec.count("requests")
        s.dirty = True
        chunks = 0
        try:
            with (
                httpx.Client(
                    base_url=self.ctl.server.base_url,
                    headers={"Authorization": f"Bearer {self.key}"},
                    timeout=httpx.Timeout(self.ctl.deadline_s, connect=10.0),
                ) as c,
                c.stream("POST", path, json=body) as resp,
            ):
                if resp.status_code != 200:
                    resp.read()
                    self._status("disconnect", resp.status_code, resp.text, (200,))
                for ev in self._sse(resp):
                    if isinstance(ev, dict) and any(
                        (ch.get("delta") or {}).get("content") for ch in ev.get("choices") or []
                    ):
                        chunks += 1
                    if chunks >= 2 or ev == "[DONE]" or (isinstance(ev, dict) and "error" in ev):
                        break
        except httpx.TimeoutException as exc:
            raise self._outcome("disconnect", gen0, t0, exc, timeout=True) from None
        except httpx.TransportError as exc:
            raise self._outcome("disconnect", gen0, t0, exc, timeout=False) from None
        self.rec.count("disconnects")
        time.sleep(0.3)
        self.resync(s, ghost_from=before)

    def create(self) -> None:
        s = self.new_session(stored=True)
        s.dirty = True
        self.req("create", "POST", "/v1/sessions", {"session_id": s.sid, "system_prompt": s.system}, (201,))
        s.dirty = False

    def rollback(self) -> None:
        options = [(s, b, h) for s in self.sessions.values() for b, h in s.branches.items() if h > 0]
        if not options:
            return
        s, branch, head = self.rng.choice(options)
        chain, v = [], head
        while v is not None and v in s.parents:
            chain.append(v)
            v = s.parents[v]
        if not chain:
            return
        to = self.rng.choice(chain)
        s.dirty = True
        r = self.req(
            "rollback",
            "POST",
            f"/v1/sessions/{s.sid}/rollback",
            {"to_version": to, "branch": branch, "expected_head": head},
        )
        if r.json().get("head_version") != to:
            self.rec.count("unexpected")
            self.rec.event("rollback_wrong_head", user=self.user, asked=to, got=r.json())
        s.branches[branch] = to
        s.dirty = False
        self.rec.count("rollbacks")

    def branch(self) -> None:
        options = [(s, n) for s in self.sessions.values() for n in s.known if len(s.branches) < MAX_BRANCHES]
        if not options:
            return
        s, n = self.rng.choice(options)
        s.n_branches += 1
        name = f"alt-{s.n_branches}"
        s.dirty = True
        self.req(
            "branch", "POST", f"/v1/sessions/{s.sid}/branches", {"from_version": n, "name": name}, (201,)
        )
        s.branches[name] = n
        s.dirty = False
        self.rec.count("branches")

    def read(self) -> None:
        """List a session's versions: every acknowledged one must be there (an online check)."""
        if not self.sessions:
            return
        s = self.rng.choice(list(self.sessions.values()))
        if not any(k[0] == s.sid for k in self.ledger):
            return
        listed: set[int] = set()
        after = 0
        while True:  # the listing comes in pages of limits.max_list_limit
            page = self.req("read", "GET", f"/v1/sessions/{s.sid}/versions?after={after}").json()
            listed |= {v["number"] for v in page["data"]}
            if not page["has_more"]:
                break
            after = int(page["last_id"])
        for (sid, n), e in list(self.ledger.items()):
            if sid == s.sid and n not in listed:
                self.ctl.lost(self, e, "not listed (online read)", {"listed": sorted(listed)})

    def delete_random(self) -> None:
        if self.sessions:
            self.delete(self.rng.choice(sorted(self.sessions)))

    def delete(self, sid: str) -> None:
        self.pending_delete.add(sid)
        self.req("delete", "DELETE", f"/v1/sessions/{sid}", expect=(200, 404))
        self.pending_delete.discard(sid)
        gone = self.sessions.pop(sid, None)
        if gone is not None:
            self.deleted_markers.append(gone.marker)
        for k in [k for k in self.ledger if k[0] == sid]:
            del self.ledger[k]
        self.rec.count("deletes")

    def erase(self) -> None:
        """DELETE /v1/users/{me} with the admin key; the user then starts again from nothing."""
        self.pending_erase = True
        last = next(reversed(self.ledger.values()), None)
        r = self.req("erase", "DELETE", f"/v1/users/{self.user}", client=self.admin)
        receipt = r.json()
        self.pending_erase = False
        self.receipts.append(receipt["id"])
        ver = receipt.get("verification") or {}
        if ver.get("remnants", 1) != 0 or not ver.get("chain_ok", False):
            self.rec.count("remnants", max(1, int(ver.get("remnants") or 0)))
            self.rec.event("erasure_remnants", user=self.user, verification=ver)
        self.erased_markers += self.epoch_markers
        self.epoch_markers = []
        self.sessions.clear()
        self.ledger.clear()
        self.pending_delete.clear()
        self.epoch += 1
        self.next_sid = 0  # the erased session ids are used again
        self.rec.count("erasures")
        left = self.req("erase_check", "GET", "/v1/sessions").json()["data"]
        if left:
            self.rec.count("remnants", len(left))
            self.rec.event("sessions_after_erasure", user=self.user, sessions=[x["id"] for x in left])
        if last is not None:  # the same prompt again: nothing of the erased user may be cached
            prompt = last.messages[:-1]
            body = {"model": "default", "messages": prompt, "max_tokens": 1, "temperature": 0}
            usage = self.req("erase_check", "POST", "/v1/chat/completions", body).json()["usage"]
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if cached:
                self.rec.count("remnants")
                self.rec.event("cached_after_erasure", user=self.user, cached_tokens=cached)

    def resync(self, s: Sess, ghost_from: int | None = None) -> None:
        """Re-read a session whose state is uncertain (never adds to the ledger)."""
        r = self.req("resync", "GET", f"/v1/sessions/{s.sid}", expect=(200, 404))
        if r.status_code == 404:
            entries = [e for (sid, _), e in self.ledger.items() if sid == s.sid]
            for e in entries:
                self.ctl.lost(self, e, "session gone (resync)", {})
            self.sessions.pop(s.sid, None)
            return
        info = r.json()
        count = int(info["version_count"])
        if ghost_from is not None and count > ghost_from:
            self.rec.count("ghost_commits", count - ghost_from)
        s.vcount = max(s.vcount, count)
        s.branches = {b["name"]: int(b["head_version"]) for b in info["branches"]}
        for head in set(s.branches.values()):
            if head > 0 and head not in s.known:
                v = self.req("resync", "GET", f"/v1/sessions/{s.sid}/versions/{head}").json()
                s.known[head] = v["messages"]
                s.parents[head] = v["parent"]
        s.dirty = False


# -------------------------------------------------------------------------------- controller
class Controller:
    def __init__(self, args: argparse.Namespace, out: Path, data_dir: Path) -> None:
        self.args = args
        self.out = out
        self.data_dir = data_dir
        self.deadline_s = float(args.deadline_s)
        self.replay_fraction = float(args.replay_fraction)
        self.erase_weight = float(args.erase_weight)
        self.gate = Gate()
        self.rec = Recorder(out / "events.jsonl")
        self.lost_keys: set[tuple[str, int, int, str]] = set()
        self.lost_lock = threading.Lock()
        self.restart_failures = 0
        self.verified = 0
        users = [f"soak-user-{i}" for i in range(args.clients)]
        t0 = time.monotonic()
        self.admin_key = create_key(data_dir, None)
        self.replay_key = create_key(data_dir, "soak-replay")
        keys = [create_key(data_dir, u) for u in users]
        print(f"created {len(keys) + 2} API keys in {time.monotonic() - t0:.1f} s", flush=True)
        port = args.port or free_port()
        self.server = Server(data_dir, port, out / "server.log", self.admin_key)
        self.clients = [
            Client(i, u, k, self, args.seed) for i, (u, k) in enumerate(zip(users, keys, strict=True))
        ]

    def lost(self, client: Client, e: Entry, why: str, detail: dict[str, Any]) -> None:
        key = (client.user, client.epoch, e.number, e.sid)
        with self.lost_lock:
            if key in self.lost_keys:
                return
            self.lost_keys.add(key)
        client.ledger.pop((e.sid, e.number), None)
        self.rec.count("lost_versions")
        self.rec.event(
            "lost_version",
            user=client.user,
            session=e.sid,
            number=e.number,
            parent=e.parent,
            branch=e.branch,
            via=e.via,
            why=why,
            expected=e.messages[-2:],
            **{k: str(v)[:1500] for k, v in detail.items()},
        )

    # ------------------------------------------------------------------------------ checking
    def _versions(self, client: httpx.Client, sid: str) -> dict[int, Any] | int | None:
        """Every listed version of the session by number, page after page (the listing comes in
        pages of limits.max_list_limit); a page's status when it is not 200; None when a page
        failed (recorded by `_get`)."""
        listed: dict[int, Any] = {}
        after = 0
        while True:
            r = self._get(client, f"/v1/sessions/{sid}/versions?after={after}")
            if r is None or r.status_code != 200:
                return None if r is None else r.status_code
            page = r.json()
            listed.update({v["number"]: v for v in page["data"]})
            if not page["has_more"]:
                return listed
            after = int(page["last_id"])

    def _get(self, client: httpx.Client, path: str) -> httpx.Response | None:
        self.rec.count("requests")
        try:
            r = client.get(path)
        except httpx.HTTPError as exc:
            self.rec.count("unexpected")
            self.rec.event("verify_error", path=path, error=repr(exc))
            return None
        if r.status_code >= 500:
            self.rec.count("errors_5xx")
            self.rec.event("5xx", op="verify", path=path, status=r.status_code, body=r.text[:2000])
            return None
        return r

    def verify_ledgers(self, phase: str) -> int:
        """Every acknowledged version must still be listed, with its parent, branch, messages."""
        checked = 0
        for c in self.clients:
            sids = sorted({sid for sid, _ in c.ledger})
            for sid in sids:
                entries = [e for (s, _), e in c.ledger.items() if s == sid]
                listed = self._versions(c.http, sid)
                if listed is None:
                    continue
                if isinstance(listed, int):
                    what = "session not found" if listed == 404 else f"versions listing {listed}"
                    for e in entries:
                        self.lost(c, e, f"{what} ({phase})", {})
                    continue
                for e in entries:
                    checked += 1
                    v = listed.get(e.number)
                    if v is None:
                        self.lost(c, e, f"not listed ({phase})", {"listed": sorted(listed)})
                        continue
                    if v["parent"] != e.parent or v["branch"] != e.branch:
                        self.lost(c, e, f"other parent/branch ({phase})", {"listed": v})
                        continue
                    d = self._get(c.http, f"/v1/sessions/{sid}/versions/{e.number}")
                    if d is None:
                        continue
                    if d.status_code != 200:
                        self.lost(c, e, f"version read {d.status_code} ({phase})", {"body": d.text})
                    elif d.json()["messages"] != e.messages:
                        self.lost(c, e, f"other messages ({phase})", {"got": d.json()["messages"][-2:]})
        self.verified += checked
        return checked

    def db_scan(self) -> tuple[int, int]:
        """Erased sessions' marker strings in the SQLite files (and, for information, deleted ones')."""
        blobs = b""
        for p in sorted(self.data_dir.glob("dss.sqlite3*")):
            with contextlib.suppress(OSError):
                blobs += p.read_bytes()
        erased = deleted = 0
        for c in self.clients:
            for mk in c.erased_markers:
                n = blobs.count(mk.encode())
                if n:
                    erased += n
                    self.rec.event("db_marker_after_erasure", user=c.user, marker=mk, hits=n)
            for mk in c.deleted_markers:
                deleted += blobs.count(mk.encode())
        return erased, deleted

    def reverify_receipts(self) -> int:
        bad = 0
        admin = self.clients[0].admin if self.clients else None
        for c in self.clients:
            for rid in c.receipts:
                assert admin is not None
                r = self._get(admin, f"/v1/erasures/{rid}")
                if r is None:
                    continue
                v = r.json().get("verification", {}) if r.status_code == 200 else {}
                if r.status_code != 200 or v.get("remnants") != 0 or not v.get("chain_ok"):
                    bad += max(1, int(v.get("remnants") or 0))
                    self.rec.event(
                        "receipt_remnants", user=c.user, receipt=rid, status=r.status_code, body=r.text[:2000]
                    )
        return bad

    # ------------------------------------------------------------------------------ the run
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
        checked = self.verify_ledgers(f"after restart {self.server.starts - 1}")
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
        for c in self.clients:
            c.join(30)
        final_checked = 0
        receipts_bad = 0
        erased_hits = deleted_hits = 0
        if self.server.proc is not None:
            self.server.scrape()
            for c in self.clients:
                c.resolve()
            final_checked = self.verify_ledgers("final")
            receipts_bad = self.reverify_receipts()
            erased_hits, deleted_hits = self.db_scan()
        stop_rc, stop_s = self.server.stop()
        counts = self.rec.counts
        log_text = self.server.log_path.read_text(errors="replace") if self.server.log_path.exists() else ""
        tracebacks = log_text.count("Traceback (most recent call last)")
        m = self.server.metrics_total
        result = {
            "requests": counts["requests"],
            "hangs": counts["hangs"],
            "errors_5xx": counts["errors_5xx"],
            "lost_versions": counts["lost_versions"],
            "corrupt_served": int(m["dss_corrupt_pages_total"]),
            "remnants": counts["remnants"] + receipts_bad + erased_hits,
            "restarts": counts["restarts"],
            "unexpected": counts["unexpected"],  # client crashes (a bug of the soak) included
            "restart_failures": self.restart_failures,
            "greedy_checked": counts["greedy_checked"],
            "greedy_mismatch": counts["greedy_mismatch"],
            "greedy_checked_cached": counts["greedy_checked_cached"],
            "greedy_mismatch_cached": counts["greedy_mismatch_cached"],
            "greedy_checked_loaded": counts["greedy_checked_loaded"],
            "greedy_mismatch_loaded": counts["greedy_mismatch_loaded"],
            "acked_versions": counts["acked_versions"],
            "verified_versions": self.verified,
            "final_verified": final_checked,
            "interrupted": counts["interrupted"],
            "erasures": counts["erasures"],
            "deletes": counts["deletes"],
            "rollbacks": counts["rollbacks"],
            "branches": counts["branches"],
            "disconnects": counts["disconnects"],
            "ghost_commits": counts["ghost_commits"],
            "server_5xx": int(m["server_5xx"]),
            "store_errors": int(m["dss_connector_store_errors_total"]),
            "disk_write_errors": int(m["dss_disk_write_errors_total"]),
            "evictions": int(m["evictions"]),
            "db_marker_hits": erased_hits,
            "deleted_marker_hits": deleted_hits,
            "server_tracebacks": tracebacks,
            "stop_rc": stop_rc,
            "stop_s": round(stop_s, 1),
            "wall_s": round(time.monotonic() - t_start),
        }
        summary = {
            "result": result,
            "counts": dict(counts),
            "metrics_total": dict(m),
            "start_seconds": [round(x, 1) for x in self.server.start_seconds],
            "latency_s": self.rec.latency_summary(),
            "server_root": str(SERVER_ROOT),
            "examples": self.rec.examples,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        for kind, ex in self.rec.examples.items():
            if kind in ("greedy_mismatch",):
                continue
            print(f"--- {kind} ({len(ex)} shown):", flush=True)
            for e in ex[:5]:
                print("   ", json.dumps(e, default=str)[:1500], flush=True)
        if tracebacks:
            first = log_text.index("Traceback (most recent call last)")
            print("--- first server traceback:\n" + log_text[first : first + 4000], flush=True)
        for kind, lat in summary["latency_s"].items():
            print(
                f"latency {kind}: n={lat['n']} p50={lat['p50']} p99={lat['p99']} max={lat['max']} s",
                flush=True,
            )
        print(f"out: {self.out}", flush=True)
        failed = [k for k in (*FAIL_KEYS, "restart_failures") if result[k]]
        print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of traffic (restarts excluded)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--kill-every-s", type=float, default=90.0, help="SIGKILL period (+-20 %%); 0 = never")
    p.add_argument("--max-kills", type=int, default=-1, help="at most this many kills (-1 = no limit)")
    p.add_argument("--data-dir", type=Path, default=None, help="a new or empty folder (default: OUT/data)")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="summary.json, events.jsonl, server.log")
    p.add_argument("--deadline-s", type=float, default=60.0, help="client deadline of every request")
    p.add_argument("--replay-fraction", type=float, default=0.25, help="non-streamed turns replayed cold")
    p.add_argument("--erase-weight", type=float, default=1.2, help="weight of erasures (chat turns: 24)")
    p.add_argument(
        "--server-root",
        type=Path,
        default=os.environ.get("DSS_SOAK_SERVER_ROOT") or None,
        help="run this copy of the code (default: $DSS_SOAK_SERVER_ROOT, else the checkout)",
    )
    args = p.parse_args(argv)
    global SERVER_ROOT
    if args.server_root is not None:
        SERVER_ROOT = args.server_root.resolve()
    out = args.out or Path(tempfile.mkdtemp(prefix="dss-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("events.jsonl", "server.log", "summary.json"):
        (out / name).unlink(missing_ok=True)
    data_dir = args.data_dir or out / "data"
    if data_dir.exists() and any(data_dir.iterdir()):
        raise SystemExit(f"{data_dir} is not empty: the soak needs a fresh data directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    ctl = Controller(args, out, data_dir)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return ctl.run()
    finally:
        ctl.gate.stop.set()
        ctl.server.kill()


if __name__ == "__main__":
    sys.exit(main())
