"""Tests of `dss.ops`: erasure, retention and the other operations across the rooms."""
