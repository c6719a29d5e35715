"""Whole-store changes of what the stored data is keyed under: `master_rotation` (re-wrapping every
key under a new master key, offline) and `derivation_upgrade` (the one-time move to the
length-prefixed tenant derivation, at open)."""
