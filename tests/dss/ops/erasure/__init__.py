"""Tests of `dss.ops.erasure`: erasing a user, its receipts, their chain and verification."""
