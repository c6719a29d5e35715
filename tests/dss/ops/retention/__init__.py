"""Tests of `dss.ops.retention`: session retention hints, idle TTLs, warm-ups."""
