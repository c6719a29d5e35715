"""Erasing a user and proving it: `eraser` (`Eraser`), `receipts` (`ErasureReceipt`, appending to
and reading the receipt chain), `verify` (`Verification`), `chain` (the hash chain and its sealed
checkpoints), `wal_scrub` (`WalScrubber`: SQLite's WAL copies of erased rows)."""
