"""Soak and fault campaign: the real `dss serve` under mixed traffic on every route, with erasures
racing it, SIGKILLed and restarted.

What it does (docs/operations.md, "Soak and fault campaign", says how to read the result):

- creates API keys (`dss keys create`) for one user per client (client 1's id is
  `soak@org/user-1` unless `--no-odd-user-id` or `dss keys create` refuses it: every id the
  server accepts must be erasable), one admin and one replay user in a fresh data directory,
  then starts `dss serve` as a subprocess in its own process group, with small tiers (host arena
  64 MiB, disk 256 MiB, vLLM KV cache 1 GiB) so that eviction runs;
- runs `--clients` threads for `--duration-s` seconds of traffic (time spent restarting does not
  count), each as its own user, mixing every route a user has, generations kept short (4-16
  tokens): chat turns with `session_id` through the official `openai` client (streamed and not,
  greedy), `n` = 2 alternatives (sibling versions), stateful `/messages` turns (streamed and not),
  the Responses API (`POST /v1/responses`, streamed and not, chains through
  `previous_response_id`, forks at older responses, `store: false`; `GET` a response and its
  `input_items`; `DELETE`, with `cascade=true` for one that others continue), explicit session
  creation, rollbacks, branches (`POST`, `GET`), session reads and lists, `PATCH` retention hints,
  warm-ups, session deletes, `GET /v1/models` and `/v1/prefixes`, the client erasing its own user
  with the admin key (it then goes on with fresh sessions, reusing the erased ids), and streams
  the client drops after two chunks;
- an operator thread races the clients: every `--race-erase-every-s` (+-50 %) it erases one of
  the clients' users while that user's traffic runs (`DELETE /v1/users/{id}`; one time in three
  two or three at once; some with the user's own key, the others with the admin key), and now
  and then lists receipts (`GET /v1/erasures`), re-reads one (`GET /v1/erasures/{id}`), creates,
  lists and deletes public prefixes, reads `/healthz`, `/readyz`, `/v1/models` and the console;
- a frontend thread (`--end-users`, 3 by default) acts for end users of one frontend key
  (`dss keys create --frontend`), each request naming its end user by `X-DSS-User`, the
  frontend's own user header or the body's `user`: chat turns in sessions named by the body's
  `session_id`, `X-DSS-Session` or the frontend's session header, the Conversations API (create,
  add items, delete an item, delete a conversation), Responses in a conversation, reads of their
  own things, of each other's and of the plain users' (and a plain user reading theirs); every
  `--race-erase-every-s` (+-50 %) of its traffic it erases one end user through the frontend key
  (`DELETE /v1/users/{end user}`) while a write of that end user runs, then reads back everything
  the end user held;
- every `--kill-every-s` seconds of traffic (+-20 %) sends SIGKILL to the whole process group (the
  API process and the engine's children), restarts the server on the same data directory and
  waits for `/readyz`;
- keeps a client-side ledger of every version the server acknowledged (session, number, parent,
  branch, the messages as sent plus the answer as returned; for a response, its answer and id),
  minus what the client itself deleted or erased. After each restart and at the end, with the
  traffic paused, every ledger entry is checked through `GET /v1/sessions/{sid}/versions`, `GET
  .../versions/{n}` (and `GET /v1/responses/{id}`).

Every request has a client deadline (`--deadline-s`). The counts of the last line:

- `requests`: HTTP requests sent (traffic, checks and the operator's, `/metrics` scrapes aside).
- `hangs`: requests that passed their deadline (no answer, or an answer that came late), and
  pauses whose requests in flight never finished.
- `errors_5xx`: answers with a 5xx status the soak got (`server_5xx` in the DETAIL line: what the
  server counted, also for clients gone; `/readyz` while starting aside).
- `lost_versions`: versions acknowledged (200 with `state_version`) that are not readable later -
  not listed, listed with another parent or branch, other messages, or (a response) `GET
  /v1/responses/{id}` not 200 - unless an erasure of their user ran after their request was sent
  (such an erasure may have taken them: `erased_versions`). A version acknowledged while an
  erasure of its user ran is never in the ledger (`acked_during_erasure`).
- `corrupt_served`: answers that differ from a cold recompute beyond rounding, plus pages that
  failed their checksum or authentication on their way to the engine (`dss_corrupt_pages_total`
  from `/metrics`, summed over the server's lives; scraped every 5 s and before each kill). The
  cold recompute: a `--replay-fraction` of non-streamed greedy session turns is replayed by
  another user (its own cache namespace) as a plain request with the same messages; where the
  texts differ (`greedy_mismatch`: a few percent on this CPU bf16 build whatever the cache did,
  batch composition moves the rounding), the first differing token is judged from the
  log-probabilities: a cold run that preferred its own token by more than `CORRUPT_MARGIN` nats
  over the one served is not rounding (`corrupt_answers`). Turns whose prompt differs in length
  from the replay's (stored ids that do not tokenize back) are left out (`greedy_prompt_differs`).
- `remnants`: the sum of the verification remnants of every erasure's receipt, read again with
  `GET /v1/erasures/{id}` after the traffic settled (a receipt that cannot be read, or whose
  chain is broken, counts 1).
- `restarts`: kills survived.

The DETAIL line before it adds, among others: `unexpected` (a connection error no kill explains,
an answer a valid request should not get, a crash of the soak itself), `remnants_at_erasure` (the
verification each DELETE answered with), `pre_erasure_kept` (a turn sent before an erasure of its
user began, acknowledged while it ran, and still readable after it: issue 19, item 4),
`leftovers` (after a client's own erasure: sessions still listed, cached tokens for a replay of
its prompt, its marker strings in `dss.sqlite3*`), `erased_4xx` / `erased_aborted` (requests of a
user whose erasure raced them answered 404, 409 or 410, or ended by an `error` event: the
erasure won, as it may; never counted as errors), `interrupted` (requests cut by a kill: their
outcome is unknown, the client re-reads and never adds an unacknowledged version).

The end users' counts in the DETAIL line (`bench/_soak/end_user_checks.py`):
`end_user_remnants` (a session, conversation, item or response of an erased end user whose last
write ended before the erasure was sent, still visible through any route after the erasure
answered - its `GET`s, the conversation's items, the response's input items, `GET
/v1/sessions` - or the end user still listed by the frontend's `GET /v1/users` though it wrote
nothing since), `end_user_pre_erasure_kept` (the same for a write sent before the erasure and
answered after it: it was erased or refused, never kept under the old epoch), `end_user_leaks`
(an end user reading or listing another end user's or a plain user's things, a plain user
reading an end user's, `GET /v1/users` naming someone not of the frontend), `end_user_lost`
(something an end user holds, written after its last erasure, that does not read back).

The exit status is 1 when any of hangs, errors_5xx, lost_versions, corrupt_served, remnants,
unexpected, remnants_at_erasure, pre_erasure_kept, leftovers, restart_failures,
end_user_remnants, end_user_pre_erasure_kept, end_user_leaks or end_user_lost is not 0.
`--out` keeps summary.json, events.jsonl (every finding with its request and answer) and
server.log.

    .venv/bin/python bench/soak.py --duration-s 1200 --kill-every-s 180 --clients 4 --out /tmp/soak

The code is the package `bench/_soak/` (its `__init__` names each module's job); this script is
its command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _soak.main import main

if __name__ == "__main__":
    sys.exit(main())
