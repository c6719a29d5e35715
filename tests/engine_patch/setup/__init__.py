"""Tests of `engine_patch.setup`: finding, pulling and verifying the default model."""
