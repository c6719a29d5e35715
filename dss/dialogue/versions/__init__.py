"""Versioned sessions: the durable dialogue state, with git-like branches (`VersionStore`).

One job per module: `version_store` (`VersionStore`, every piece below as a base class, and the
invariants over its tables), `sessions` (`SessionCatalog`), `writes` (`VersionWrites`),
`branches` (`Branches`), `reads` (`VersionReads`), `shared` (`VersionTables`, the state and locks
they share, `WriteFence`, and row helpers), `records` (the records its reads return, one builder
each from its rows), `rules` (input rules and limits).
"""

from dss.dialogue.versions.records import (
    BranchInfo,
    RetentionHint,
    SessionInfo,
    VersionInfo,
    VersionSummary,
    VersionTokens,
)
from dss.dialogue.versions.rules import (
    EMPTY_HEAD,
    KV_RETENTIONS,
    MAIN_BRANCH,
    MAX_IDLE_TTL_S,
    MAX_LIST_LIMIT,
    MAX_MESSAGES_BYTES,
    MAX_METADATA_BYTES,
    MAX_SYSTEM_PROMPT_CHARS,
    MAX_TOKENS,
    MIN_IDLE_TTL_S,
    check_retention,
)
from dss.dialogue.versions.shared import MAX_COMMIT_ATTEMPTS, WriteFence
from dss.dialogue.versions.version_store import VersionStore

__all__ = [
    "EMPTY_HEAD",
    "KV_RETENTIONS",
    "MAIN_BRANCH",
    "MAX_COMMIT_ATTEMPTS",
    "MAX_IDLE_TTL_S",
    "MAX_LIST_LIMIT",
    "MAX_MESSAGES_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_SYSTEM_PROMPT_CHARS",
    "MAX_TOKENS",
    "MIN_IDLE_TTL_S",
    "BranchInfo",
    "RetentionHint",
    "SessionInfo",
    "VersionInfo",
    "VersionStore",
    "VersionSummary",
    "VersionTokens",
    "WriteFence",
    "check_retention",
]
