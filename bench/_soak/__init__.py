"""The soak and fault campaign behind `bench/soak.py` (its docstring says what the run does and
how to read its verdict), one job a module:

- `main`: the command line; `controller`: keys, the server's lives (start, SIGKILL, restart), the
  traffic's clock, the checks' schedule;
- `client`: one user's traffic thread and its ledger, composed of `turns` (chat, `/messages`,
  dropped streams, the cold replay), `response_calls` (the Responses API), `session_calls`
  (session routes, reads, re-reads) and `own_erasure` (erasing itself, catching up with erasures
  of its user);
- `admin`: the operator thread racing the clients with erasures and admin routes;
- `end_users`: the frontend thread, acting for a few end users through one frontend key
  (sessions, conversations, responses in them) and erasing them while their writes run;
  `end_user_checks`: what an erased end user may no longer show, what the others must keep and
  never see of each other;
- `erasures`: the run's log of erasures (which versions an erasure may have taken);
- `verify`: the ledger checks after each restart and at the end, and the one place a version is
  declared lost; `report`: `summary.json` and the DETAIL and RESULT lines;
- `model`: the ledger's records; `calls`: the gate, the recorder, requests with deadlines and
  their classification; `server`: API keys and `dss serve` in its own process group (also used by
  `bench/schemathesis_stateful.py`).

Imports point one way: `main` → `controller` → (`client`, `admin`, `end_users`, `verify`, `report`) → parts →
`model`, `calls`, `server`; a part names the client or the controller only for typing."""
