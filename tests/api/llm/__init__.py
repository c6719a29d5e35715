"""Tests of `api.llm`: the embedded engine's request validation, sampling and tool parsing."""
