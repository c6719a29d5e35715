"""Tests of `dss.ops.key_changes`: master-key rotation and the derivation upgrade."""
