"""Operations over several parts, one room each: `kv` (KV loads and saves for engines, the disk
writer, public prefixes), `erasure` (erasing a user and proving it), `retention` (session
retention hints), `key_changes` (master-key rotation, the derivation upgrade), `session_kv` (a
session's stored KV and its deletion), `recovery` (the rebuild at start-up)."""
