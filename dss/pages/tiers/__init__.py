"""Page tiers: where page bytes live.

Each backend stores opaque page bytes by `PageHash` within a byte capacity and knows nothing of
the trie, versions or eviction policy (those live in `dss.pages.placement`). Fast to slow:
`host` (shared-memory arena readable by other processes), `disk` (compressed, checksummed,
encrypted files), `remote` (Redis, shared by a fleet).

Each backend's `_lock` is a leaf around its own bookkeeping (slot lists, file sizes); copies,
zeroing, encoding and file I/O run outside it. The page table (`dss.pages.table`) never holds its
lock while it calls a backend.
"""
