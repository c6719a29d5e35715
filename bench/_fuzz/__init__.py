"""The parts of `bench/schemathesis_stateful.py` (its docstring says what the campaign does), one
job a module: `links` (the OpenAPI links added to the app's schema), `hooks` (the two custom
checks schemathesis imports), `runs` (a schemathesis run, its report, the fuzzed server's
settings), `probes` (the hostile requests), `race` (the erasures racing a run), `end_users` (a
frontend's keys over REST, and the probe of what an end user's erasure must take and leave). The
server and key helpers are the soak's (`_soak.server`)."""
