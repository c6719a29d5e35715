"""Tests of `dss.index` (the token trie, prefix index, tail pages)."""
