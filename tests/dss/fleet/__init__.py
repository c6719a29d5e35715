"""Tests of `dss.fleet`: several servers on one database."""
