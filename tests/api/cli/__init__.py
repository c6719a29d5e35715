"""Tests of `api.cli`: the `dss` command (`dss serve`, its flags, its start-up and refusals)."""
