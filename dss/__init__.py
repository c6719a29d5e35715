"""DSS core: the dialogue state store.

Parts (each a package with one job; see docs/architecture.md): `index` (hashing, the radix trie, the
per-namespace prefix index), `pages` (page table, tiers, eviction, page format and codecs), `keys`
(crypto, identity, data keys, cache salts), `dialogue` (versions, branches, turn targets), `ops`
(rooms over several parts: KV loads/saves with the disk writer and public prefixes, erasure,
retention, master-key rotation and the derivation upgrade, a session's KV and its deletion,
recovery), `store` (the composition root: wires the parts, exposes them by name), `wire` (the typed
cross-process contract), `rpc` (the local RPC with deadlines), `derive` (length-prefixed inputs of
every keyed hash), `db` (SQLAlchemy models and migrations).

Import rules: `dss` never imports vLLM, FastAPI, `api` or `engine_patch`; `pages` and `index`
never import each other; only `ops` and `store` combine parts; every lock is a leaf but the two
docs/architecture.md names ("Locks").
"""

__version__ = "0.1.0"
