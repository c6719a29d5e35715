"""Tests of `dss.db`: the schema and its migrations."""
