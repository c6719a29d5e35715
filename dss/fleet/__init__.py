"""Several servers on one PostgreSQL database: server ids, membership, fleet-wide erasure.

`members`: this server's id, its row in `servers` and its heartbeat. `erasures`: the erasing
server's notification and acknowledgement rows, and the follower thread with which every other
server applies and acknowledges receipts. `page_drops`: a session deleted on one server reaches
every other server's copies of its pages (applied by the same follower). Imports only `dss.db`
and `dss.types`; what applying a receipt or a page drop means for this server's tiers is passed
in (`Eraser.apply_fleet_erasure`, `Sessions.apply_fleet_drop` in `dss.ops`).
With SQLite (one server) nothing here runs.
"""
