"""Tests of `api/console/`: the web console in a real browser."""
