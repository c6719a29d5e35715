"""The soak's verdict: `summary.json` (the counts, the server's metrics over its lives, start
times, latencies, examples of every finding) and the last two lines, `DETAIL ...` and
`RESULT ...` (docs/operations.md, "Soak and fault campaign", says how to read them). The exit
status is 1 when any of `FAIL_KEYS` is not 0."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import server as server_module
from .calls import Recorder
from .server import Server

FAIL_KEYS = (
    "hangs",
    "errors_5xx",
    "lost_versions",
    "corrupt_served",
    "remnants",
    "unexpected",
    "restart_failures",
    "remnants_at_erasure",
    "pre_erasure_kept",
    "leftovers",
    "end_user_remnants",
    "end_user_pre_erasure_kept",
    "end_user_leaks",
    "end_user_lost",
)


@dataclass
class RunEnd:
    """What the controller measured besides the recorder's counts and the server's metrics."""

    final_checked: int  # ledger entries checked at the end
    receipts_bad: int  # `Verifier.reverify_receipts`
    erased_hits: int  # erased users' and end users' markers in the SQLite files
    deleted_hits: int  # deleted sessions' markers (for information)
    restart_failures: int
    verified: int  # ledger entries checked over the run
    stop_rc: int | None
    stop_s: float
    wall_s: float


def report(out: Path, rec: Recorder, server: Server, end: RunEnd) -> int:
    """Write `summary.json`, print the findings' examples and the DETAIL and RESULT lines; the
    exit status."""
    counts = rec.counts
    log_text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
    tracebacks = log_text.count("Traceback (most recent call last)")
    m = server.metrics_total
    result = {
        "requests": counts["requests"],
        "hangs": counts["hangs"],
        "errors_5xx": counts["errors_5xx"],
        "lost_versions": counts["lost_versions"],
        "corrupt_served": int(m["dss_corrupt_pages_total"]) + counts["corrupt_answers"],
        "remnants": end.receipts_bad,
        "restarts": counts["restarts"],
    }
    detail = {
        "unexpected": counts["unexpected"],  # client crashes (a bug of the soak) included
        "restart_failures": end.restart_failures,
        "remnants_at_erasure": counts["remnants_at_erasure"],
        "pre_erasure_kept": counts["pre_erasure_kept"],
        "leftovers": counts["leftovers"] + end.erased_hits,
        "end_user_remnants": counts["end_user_remnants"],
        "end_user_pre_erasure_kept": counts["end_user_pre_erasure_kept"],
        "end_user_leaks": counts["end_user_leaks"],
        "end_user_lost": counts["end_user_lost"],
        "end_user_erasures": counts["end_user_erasures"],
        "end_user_erasures_held_nothing": counts["end_user_erasures_held_nothing"],
        "end_user_raced_writes": counts["end_user_raced_writes"],
        "end_user_acked": counts["end_user_acked"],
        "end_user_verified": counts["end_user_verified"],
        "erasures": counts["erasures"],
        "race_erasures": counts["race_erasures"],
        "erased_4xx": counts["erased_4xx"],
        "erased_aborted": counts["erased_aborted"],
        "erased_versions": counts["erased_versions"],
        "acked_during_erasure": counts["acked_during_erasure"],
        "corrupt_pages": int(m["dss_corrupt_pages_total"]),
        "corrupt_answers": counts["corrupt_answers"],
        "greedy_checked": counts["greedy_checked"],
        "greedy_mismatch": counts["greedy_mismatch"],
        "greedy_prompt_differs": counts["greedy_prompt_differs"],
        "greedy_checked_loaded": counts["greedy_checked_loaded"],
        "greedy_mismatch_loaded": counts["greedy_mismatch_loaded"],
        "acked_versions": counts["acked_versions"],
        "verified_versions": end.verified,
        "final_verified": end.final_checked,
        "interrupted": counts["interrupted"],
        "responses_stored": counts["responses_stored"],
        "response_deletes": counts["response_deletes"],
        "deletes": counts["deletes"],
        "rollbacks": counts["rollbacks"],
        "branches": counts["branches"],
        "disconnects": counts["disconnects"],
        "ghost_commits": counts["ghost_commits"],
        "other_parent": counts["other_parent"],
        "server_5xx": int(m["server_5xx"]),
        "store_errors": int(m["dss_connector_store_errors_total"]),
        "disk_write_errors": int(m["dss_disk_write_errors_total"]),
        "evictions": int(m["evictions"]),
        "db_marker_hits": end.erased_hits,
        "deleted_marker_hits": end.deleted_hits,
        "server_tracebacks": tracebacks,
        "stop_rc": end.stop_rc,
        "stop_s": round(end.stop_s, 1),
        "wall_s": round(end.wall_s),
    }
    summary = {
        "result": result,
        "detail": detail,
        "counts": dict(counts),
        "metrics_total": dict(m),
        "start_seconds": [round(x, 1) for x in server.start_seconds],
        "latency_s": rec.latency_summary(),
        "server_root": str(server_module.SERVER_ROOT),
        "examples": rec.examples,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for kind, ex in rec.examples.items():
        if kind in ("greedy_mismatch",):
            continue
        print(f"--- {kind} ({len(ex)} shown):", flush=True)
        for e in ex[:5]:
            print("   ", json.dumps(e, default=str)[:1500], flush=True)
    if tracebacks:
        print("--- first server traceback (its last frames):\n" + _first_traceback(log_text), flush=True)
    for kind, lat in summary["latency_s"].items():
        print(
            f"latency {kind}: n={lat['n']} p50={lat['p50']} p99={lat['p99']} max={lat['max']} s",
            flush=True,
        )
    routes = sorted(k[len("5xx by route: ") :] for k in m if k.startswith("5xx by route: "))
    if routes:
        print("server 5xx by route: " + ", ".join(f"{r} x{int(m['5xx by route: ' + r])}" for r in routes))
    print(f"out: {out}", flush=True)
    failed = [k for k in FAIL_KEYS if {**result, **detail}[k]]
    print("DETAIL " + " ".join(f"{k}={v}" for k, v in detail.items()), flush=True)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 1 if failed else 0


def _first_traceback(log_text: str, keep: int = 2500) -> str:
    """The log's first traceback, cut to its last `keep` characters: the innermost frames and the
    exception (the outer ones are the ASGI stack, the same for every request)."""
    lines = log_text[log_text.index("Traceback (most recent call last)") :].splitlines()
    end = 1
    while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
        end += 1  # frames are indented; the exception's own line is the first that is not
    text = "\n".join(lines[: end + 1])
    return text if len(text) <= keep else "...\n" + text[-keep:]
