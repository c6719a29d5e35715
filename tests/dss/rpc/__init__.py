"""Tests of `dss.rpc`: the store RPC."""
