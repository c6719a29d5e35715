"""DSS core: the dialogue state store.

Versioned sessions (`versions`), a token radix trie per namespace (`trie`), pages in tiers
(`tiers`, `pagestore`) with compression, checksums and encryption at rest (`codec`, `pagefile`,
`crypto`, `keyring`), SQL metadata (`db`), erasure with receipts (`erasure`), recovery
(`recovery`), and the facade that ties them together (`store.Store`). Engine processes reach the
owner through `rpc`.

Import rules: `dss` never imports vLLM, FastAPI, `api` or `engine_patch`; tiers never import the
trie; the store is the only module that knows all the others.
"""

__version__ = "0.1.0"
