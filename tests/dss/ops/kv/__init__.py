"""Tests of dss/ops/kv: the KV loads and saves engines make."""
