"""`bench/soak.py`'s command line: the flags, a fresh data directory and output folder, the
controller's run; SIGTERM ends the run like Ctrl-C, and the server's process group is killed
whatever happens."""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

from .controller import ODD_USER, Controller
from .server import use_server_root

DESCRIPTION = (
    "Soak and fault campaign: the real `dss serve` under mixed traffic on every route, with erasures "
    "racing it, SIGKILLed and restarted."
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
    p.add_argument(
        "--erase-weight", type=float, default=1.0, help="weight of a client erasing itself (chat turns: 20)"
    )
    p.add_argument(
        "--alt-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="`n` = 2 alternatives carry a `seed` (the CPU engine of vLLM 0.32 dies on a seeded "
        "request whose prefill is chunked: --no-alt-seed to get past that)",
    )
    p.add_argument(
        "--odd-user-id",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"client 1 is the user {ODD_USER!r} (if `dss keys create` accepts it)",
    )
    p.add_argument(
        "--race-erase-every-s",
        type=float,
        default=20.0,
        help="mean period of erasures racing the traffic (+-50 %%; 1-3 at once); 0 = none",
    )
    p.add_argument(
        "--end-users",
        type=int,
        default=3,
        help="end users of one frontend key (at most 3; 0 = no frontend): sessions, conversations, "
        "responses in them, erased through the frontend key while their writes run",
    )
    p.add_argument(
        "--server-root",
        type=Path,
        default=os.environ.get("DSS_SOAK_SERVER_ROOT") or None,
        help="run this copy of the code (default: $DSS_SOAK_SERVER_ROOT, else the checkout)",
    )
    args = p.parse_args(argv)
    if args.server_root is not None:
        use_server_root(args.server_root)
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
