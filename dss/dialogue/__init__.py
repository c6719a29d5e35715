"""The dialogue state: sessions, versions, branches, rollback, and where a chat turn attaches."""
