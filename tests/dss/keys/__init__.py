"""Tests of `dss.keys`: crypto, master rotation, identities and their derivation."""
