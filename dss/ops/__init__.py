"""Operations over several parts: KV loads and saves, the disk writer, erasure, recovery, session
deletion, public prefixes."""
