"""schemathesis with a large budget and stateful links between sessions, versions and branches.

Starts `dss serve` (real engine, default model; short generations: `max_tokens` <= 16) in a fresh
data directory with API keys (one user, one admin), fetches `/openapi.json` and adds OpenAPI
`links` to it - the app's own schema declares none, and this script must not change the app:

- `POST /v1/sessions` -> the session's reads, `/messages`, branches, versions, delete, and a chat
  turn in it (`session_id` put into the generated body);
- a chat turn or a `/messages` turn -> that version (`GET .../versions/{state_version}`), a
  rollback to it, a branch from it, a `/messages` turn on it (`version`), the version list;
- a new branch -> a `/messages` turn on it, a rollback of it, the branch list;
- a rollback -> the session, a `/messages` turn on the branch;
- the session and version lists -> their first entry;
- a session or a turn -> its retention hint (`PATCH`) and a warm-up of it (`version`);
- a response (`POST /v1/responses`) -> `GET` it, its `input_items`, `DELETE` it, a response that
  continues it (`previous_response_id`), its session and its version;
- a conversation (`POST /v1/conversations`) -> `GET` it, its items, items added, its metadata
  changed, a response in it (`conversation`), its deletion; items added or listed -> the first
  item read or deleted; an item deleted -> the items, the conversation deleted; a conversation
  deleted -> read again (it must stay gone);
- a frontend's list of end users (`GET /v1/users`) -> the erasure of the first one.

Then runs schemathesis on that schema: the fuzzing phase (`--max-examples` cases per operation)
and the stateful phase (scenarios that follow the links, plus the links schemathesis infers
itself), as the user; then the admin-only operations (and the erasure list and receipts) as the
admin; then the hostile probes (`probes`: a NUL in ids, prompts and paths, metadata 300 deep,
session ids `.` and `..`, 20,000 `stop_token_ids`, 5,000 `bad_words`, the erasure of a user
whose id has a slash): each must answer its documented 4xx (the erasure: 200), never a 5xx, and
the listing read after it must still answer; then the erasure race: fuzzing and stateful again
as a second user whom a thread erases every `--race-erase-every-s` (one time in three twice at
once) with the admin key, checked for no 5xx and documented answers only (an erasure may take a
scenario's session between two steps); every racing erasure must answer a receipt without
remnants, and every receipt is verified again at the end (`remnants`); last, the same as an end
user of a frontend key (`X-DSS-User`), with its end-user operations (listing, erasing), whom a
thread erases through the frontend key (`429 rate_limited`, the per-user limit on erasure checks,
is counted apart), planting a conversation before each erasure and reading it back after:
`end_user_remnants` (what the erased end user held, visible after the erasure answered),
`end_user_leaks` (it reads a bystander's conversation: another end user of its frontend, or one
of the same name on another frontend), `end_user_lost` (that second bystander's conversation
gone). Checks of the first two
runs: no 5xx, status codes, content types and bodies as documented, the stateful
`use_after_free` (a deleted session must stay gone) and `ensure_resource_availability` (a
created one must be found; as
`session_availability`, which lets the documented 404 of a branch or version that a generated
body names pass), and `acknowledged_version_readable` (the version a turn acknowledged can be read
through the link at once).

Prints schemathesis' summaries, each failure group (request and response, from the JSON report),
each erasure-race finding, and `RESULT cases= ... failures= server_5xx= ... remnants= ...`
(`cases`: test cases generated over the four runs; `failures`: failure groups, probes that
broke their promise, and the race's erasures that answered anything but a receipt or hung);
exits 1 on any failure. `--db-url postgresql+psycopg://...` (an empty database) runs the server
on PostgreSQL.

    .venv/bin/python bench/schemathesis_stateful.py --max-examples 80

The parts live in `bench/_fuzz/` (links, hooks, runs, probes, race); this script is the campaign's
order of runs and its verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fuzz.end_users import Bystander, EndUserProbe, frontend_key
from _fuzz.links import add_links
from _fuzz.probes import probes, run_probes
from _fuzz.race import EraseRacer
from _fuzz.runs import (
    ADMIN_ONLY,
    ADMIN_RUN,
    CHECKS,
    FRONTEND_EXCLUDED,
    RACE_CHECKS,
    FuzzServer,
    report_counts,
    run_schemathesis,
)
from _procs import free_port
from _soak.server import create_key, try_create_key, use_server_root

FRONTEND = "st-fe"  # the frontend whose end user FE_USER the last run acts as (X-DSS-User)
FE_USER = "st-fe-race"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--max-examples", type=int, default=80, help="fuzzing cases per operation")
    p.add_argument("--timeout-s", type=float, default=1500, help="kill the user run after this long")
    p.add_argument("--max-steps", type=int, default=10, help="steps per stateful scenario")
    p.add_argument("--admin-examples", type=int, default=20)
    p.add_argument("--seed", type=int, default=20250101)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--server-root", type=Path, default=None, help="run this copy of the code")
    p.add_argument(
        "--db-url",
        default=None,
        help="an empty database for the server (e.g. postgresql+psycopg://...; default: SQLite)",
    )
    p.add_argument("--race-examples", type=int, default=20, help="cases per operation of the erasure race")
    p.add_argument(
        "--race-timeout-s", type=float, default=600, help="kill the erasure race run after this long"
    )
    p.add_argument("--race-erase-every-s", type=float, default=3.0, help="mean period of the racing erasures")
    args = p.parse_args(argv)
    if args.server_root is not None:
        use_server_root(args.server_root)
    out = args.out or Path(tempfile.mkdtemp(prefix="dss-schemathesis-"))
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "data"
    if data_dir.exists() and any(data_dir.iterdir()):
        raise SystemExit(f"{data_dir} is not empty")
    data_dir.mkdir(parents=True, exist_ok=True)
    admin_key = create_key(data_dir, None, args.db_url)
    user_key = create_key(data_dir, "st-fuzz", args.db_url)
    race_user = "st-race"
    race_key = create_key(data_dir, race_user, args.db_url)
    odd_user = "probe@org/user"  # issue 19, item 1: erasable if `dss keys create` accepts it
    odd = try_create_key(data_dir, odd_user, args.db_url) is not None
    probe_findings: list[dict[str, Any]] = []
    racers: list[EraseRacer] = []
    probe: EndUserProbe | None = None
    remnants = 0
    server = FuzzServer(data_dir, args.port or free_port(), out / "server.log", admin_key)
    server.db_url = args.db_url
    t0 = time.monotonic()
    try:
        server.start()
        print(f"server ready in {time.monotonic() - t0:.0f} s ({server.base_url})", flush=True)
        schema = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
        n_links = add_links(schema)
        schema_path = out / "openapi-with-links.json"
        schema_path.write_text(json.dumps(schema, indent=1))
        print(f"{n_links} links added -> {schema_path}", flush=True)
        (out / "schemathesis.toml").write_text(f"[phases.stateful]\nmax-steps = {args.max_steps}\n")
        # A frontend's end user, erased through the frontend key; bystanders: another end user of
        # it, and an end user of the same name on a second frontend (which no run can erase).
        fe_key = frontend_key(server.base_url, admin_key, FRONTEND)
        fe_b_key = frontend_key(server.base_url, admin_key, FRONTEND + "-b")
        bystanders = [Bystander(fe_key, "st-fe-bystander", False), Bystander(fe_b_key, FE_USER, True)]
        probe = EndUserProbe(server.base_url, fe_key, FE_USER, bystanders, 120.0)
        racer_for = {
            race_key: lambda: EraseRacer(
                server.base_url, admin_key, race_user, args.race_erase_every_s, 120.0
            ),
            fe_key: lambda: EraseRacer(
                server.base_url,
                admin_key,
                FE_USER,
                args.race_erase_every_s,
                120.0,
                erase_key=fe_key,
                probe=probe,
            ),
        }
        runs = [
            (
                "user: fuzzing + stateful",
                user_key,
                [
                    "--phases", "fuzzing,stateful",
                    "--max-examples", str(args.max_examples),
                    "--seed", str(args.seed),
                    "--exclude-operation-id-regex", ADMIN_ONLY,
                ],
                args.timeout_s,
            ),
            (
                "admin: admin-only operations",
                admin_key,
                [
                    "--phases", "fuzzing",
                    "--max-examples", str(args.admin_examples),
                    "--seed", str(args.seed),
                    "--include-operation-id-regex", ADMIN_RUN,
                ],
                600,
            ),
            (
                "race: fuzzing + stateful as a user erased all along",
                race_key,
                [
                    "--phases", "fuzzing,stateful",
                    "--max-examples", str(args.race_examples),
                    "--seed", str(args.seed + 1),
                    "--exclude-operation-id-regex", ADMIN_ONLY,
                ],
                args.race_timeout_s,
            ),
            (
                "frontend: fuzzing + stateful as an end user erased all along through the frontend key",
                fe_key,
                [
                    "--phases", "fuzzing,stateful",
                    "--max-examples", str(args.race_examples),
                    "--seed", str(args.seed + 2),
                    "--header", f"X-DSS-User: {FE_USER}",
                    "--exclude-operation-id-regex", FRONTEND_EXCLUDED,
                ],
                args.race_timeout_s,
            ),
        ]  # fmt: skip
        totals: dict[str, int] = {}
        rcs: list[int] = []
        failures: list[dict[str, Any]] = []
        for i, (title, key, extra, timeout) in enumerate(runs):
            report = out / f"report-{i}.json"
            t1 = time.monotonic()
            racer = racer_for[key]() if key in racer_for and args.race_erase_every_s > 0 else None
            if racer is not None:
                racer.start()
                racers.append(racer)
            # A user erased all along loses sessions between a scenario's steps: only the
            # checks that hold whatever an erasure took (no 5xx, answers as documented).
            checks = RACE_CHECKS if key in racer_for else CHECKS
            rc, text = run_schemathesis(
                schema_path, server.base_url, key, out, report, *extra, timeout=timeout, checks=checks
            )
            if i == 1:  # after the admin run: the hostile probes, then the race
                probe_findings = run_probes(server.base_url, user_key, admin_key, odd_user if odd else None)
                print(f"=== hostile probes: {len(probes(odd_user if odd else None))} sent, "
                      f"{len(probe_findings)} broke their promise", flush=True)  # fmt: skip
            if racer is not None:
                racer.stop.set()
                racer.join(150)
                remnants += racer.reverify()
            (out / f"schemathesis-{i}.log").write_text(text)
            counts, groups = report_counts(report, text)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            rcs.append(rc)
            failures += groups
            tail = text[text.find("SUMMARY") :] if "SUMMARY" in text else text[-6000:]
            print(
                f"=== {title}: rc={rc} in {time.monotonic() - t1:.0f} s; {counts}\n{tail[-12000:]}",
                flush=True,
            )
        metrics = server.scrape() or {}
    finally:
        for racer in racers:
            racer.stop.set()
        server.stop()
    log = (out / "server.log").read_text(errors="replace") if (out / "server.log").exists() else ""
    tracebacks = log.count("Traceback (most recent call last)")
    if tracebacks:
        first = log.index("Traceback (most recent call last)")
        print("--- first server traceback:\n" + log[first : first + 4000], flush=True)
    race = {k: sum(r.counts.get(k, 0) for r in racers) for k in ("erasures", "errors_5xx", "hangs", "other")}
    eu = probe.counts if probe is not None else {}
    result = {
        "cases": totals.get("generated", 0),
        "with_failures": totals.get("with_failures", 0),
        "unique_failures": totals.get("unique_failures", 0),
        "errored": totals.get("errored", 0),
        "scenarios": totals.get("scenarios", 0),
        "links_covered": totals.get("links_covered", 0),
        "links_selected": totals.get("links_selected", 0),
        "links_added": n_links,
        "probes": len(probes(odd_user if odd else None)),
        "probe_failures": len(probe_findings),
        "failures": len(failures)
        + len(probe_findings)
        + race["errors_5xx"]
        + race["hangs"]
        + race["other"]
        + eu.get("other", 0),
        "server_5xx": int(metrics.get("server_5xx", 0)),
        "race_erasures": race["erasures"],
        "race_erasure_5xx": race["errors_5xx"],
        "race_erasure_hangs": race["hangs"],
        "race_erasure_other": race["other"],
        "race_erasure_rate_limited": sum(r.counts.get("rate_limited", 0) for r in racers),
        "remnants_at_erasure": sum(r.remnants_at_erasure for r in racers),
        "remnants": remnants,
        "end_user_planted": eu.get("planted", 0),
        "end_user_remnants": eu.get("remnants_visible", 0),
        "end_user_leaks": eu.get("leaks", 0),
        "end_user_lost": eu.get("lost", 0),
        "server_tracebacks": tracebacks,
        "rcs": "/".join(map(str, rcs)),
    }
    for g in failures:
        print(f"failure group: {json.dumps(g, default=str)}", flush=True)
    race_findings = [f for r in racers for f in r.findings] + (probe.findings if probe is not None else [])
    for f in race_findings:
        print(f"erasure race: {json.dumps(f, default=str)}", flush=True)
    for f in probe_findings:
        print(f"probe: {json.dumps(f, default=str)}", flush=True)
    (out / "result.json").write_text(
        json.dumps(
            {"result": result, "failures": failures[:50], "race": race_findings, "probes": probe_findings},
            indent=1,
            default=str,
        )
    )
    print(f"out: {out}", flush=True)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    ok = all(rc == 0 for rc in rcs) and not failures and result["server_5xx"] == 0
    zero = (
        "failures",
        "remnants",
        "remnants_at_erasure",
        "end_user_remnants",
        "end_user_leaks",
        "end_user_lost",
    )
    ok = ok and not any(result[k] for k in zero)
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    os._exit(130)
