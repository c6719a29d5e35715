"""Several servers on one PostgreSQL database: server ids, membership, fleet-wide erasure.

`members`: this server's id, its row in `servers` and its heartbeat. `erasures`: the erasing
server's notification and acknowledgement rows, and the follower thread with which every other
server applies and acknowledges receipts. Imports only `dss.db` and `dss.types`; what applying a
receipt means for this server's tiers is passed in (`dss.ops.erasure.Eraser.apply_fleet_erasure`).
With SQLite (one server) nothing here runs.
"""
