"""Tests of `api`: the HTTP server, its CLI (`dss serve`, `dss keys`) and the web console."""
