"""Tests of `api.shapes`: the wire shapes (one shape across the API, parity with vLLM's server)."""
