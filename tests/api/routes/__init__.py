"""Tests of `api.routes`: the REST resources (chat, sessions, versions, Responses, Conversations,
users and erasure)."""
