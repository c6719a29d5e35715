"""Versioned sessions: the durable dialogue state, with git-like branches (`VersionStore`).

One job per module: `store` (`VersionStore`, the facade the rest of DSS uses, composed of the
pieces below), `sessions` (`SessionCatalog`), `commits` (`Commits`), `branches` (`Branches`),
`reads` (`VersionReads`), `tokens` (`TokenReads`), `tree` (`VersionTree` and walks of a parent
map), `deletion` (`Deletions`), `fence` (`WriteFence`, `UserFence`), `rows` (row helpers the
pieces share), `records` (the records its reads return, one builder each from its rows), `rules`
(input rules and limits), `check` (the invariants over its tables).
"""

from dss.dialogue.versions.fence import WriteFence
from dss.dialogue.versions.records import (
    BranchInfo,
    RetentionHint,
    SessionInfo,
    VersionInfo,
    VersionSummary,
    VersionTokens,
)
from dss.dialogue.versions.rows import MAX_COMMIT_ATTEMPTS
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
from dss.dialogue.versions.store import VersionStore

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
