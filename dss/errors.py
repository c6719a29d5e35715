"""Every error the store raises on purpose.

The API maps these classes to HTTP status codes in one place (`api/http_errors.py`);
nothing in `dss` knows about HTTP.
"""

from __future__ import annotations


class DSSError(Exception):
    """Base class of every deliberate DSS error."""


# --- lookups (HTTP 404) -------------------------------------------------------
class NotFoundError(DSSError):
    """Something the caller named does not exist (or is not theirs to see)."""


class SessionNotFound(NotFoundError):
    pass


class VersionNotFound(NotFoundError):
    pass


class BranchNotFound(NotFoundError):
    pass


class PrefixNotFound(NotFoundError):
    pass


class ReceiptNotFound(NotFoundError):
    pass


class ResponseNotFound(NotFoundError):
    """A stored Responses API response does not exist (or is another user's)."""


class ConversationNotFound(NotFoundError):
    """A conversation (a session, `dss.dialogue.conversations`) does not exist (or is another
    user's)."""


class ConversationItemNotFound(NotFoundError):
    """A conversation holds no item of that id."""


class ApiKeyNotFound(NotFoundError):
    """An API key id names no key (`api.keys.api_keys.ApiKeys`), or an active one where that is asked."""


class FrontendNotFound(NotFoundError):
    """A frontend name names no registered frontend (`api.keys.frontends`)."""


# --- conflicts (HTTP 409) -----------------------------------------------------
class ConflictError(DSSError):
    """The request is well-formed but contradicts the current state."""


class UserErased(ConflictError):
    """The user was erased while this request was in flight (it was admitted under an earlier
    erasure epoch than the user has now): nothing it would have written was kept. A retry is a
    new request of the re-created user."""


class ErasedDuringGeneration(UserErased):
    """The user was erased while an answer was being generated for them; nothing of it was kept."""


class BranchExists(ConflictError):
    pass


class SessionExists(ConflictError):
    pass


class StaleHead(ConflictError):
    """An optimistic commit lost a race: the branch head moved since it was read."""


class ResponseExists(ConflictError):
    """A response id is already stored (ids are random: a client replayed a record)."""


class NotAnAncestor(ConflictError):
    """A rollback target is not on the branch's history."""


class StateVersionMismatch(ConflictError):
    """A chat turn names a `state_version` its messages do not extend (they must repeat that
    version's messages, then add at least one)."""


class ForkNamesExhausted(ConflictError):
    """No free branch name was left for an automatic fork (`fork-v<n>`, `fork-v<n>-2`, ...)."""


class ResponseHasDescendants(ConflictError):
    """A response cannot be deleted alone: other responses (or versions committed through the
    session API) continue from its version. Nothing was deleted; `response_ids` names those
    responses, `versions` every descendant version number. Delete with cascade to remove them all."""

    def __init__(self, message: str, response_ids: list[str], versions: list[int]) -> None:
        super().__init__(message)
        self.response_ids = response_ids
        self.versions = versions


class FrontendExists(ConflictError):
    """A frontend of that name is registered already."""


class FrontendNameTaken(ConflictError):
    """Stored data already holds users named `<name>/...` (ids of an older version, which allowed
    `/`): a frontend of that name would act as them."""


# --- quotas (HTTP 429) ---------------------------------------------------------
class QuotaExceeded(DSSError):
    """A per-user quota (sessions, versions, stored bytes) would be exceeded; nothing was written."""

    def __init__(self, message: str, retry_after_s: int = 3600) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# --- bad input (HTTP 400) -----------------------------------------------------
class InvalidInput(DSSError):
    """A value is malformed or out of the allowed range."""


class InvalidUserId(InvalidInput):
    """A user id outside the alphabet (`dss.inputs`): `/`, a control character, blank, too long."""


class InvalidSessionId(InvalidInput):
    """A session id outside the alphabet (`dss.inputs`), or `.` / `..`."""


class InvalidText(InvalidInput):
    """A request's text holds a NUL character (`dss.inputs.check_text`)."""


class InvalidUnicode(InvalidText):
    """A request's text holds a lone surrogate: it has no UTF-8 form (`dss.inputs.check_text`)."""


class PageShapeMismatch(InvalidInput):
    """Page bytes do not have the size the namespace's model fingerprint implies."""


class FingerprintMismatch(InvalidInput):
    """A page or request names a model fingerprint other than the one expected."""


class LimitExceeded(InvalidInput):
    """A size limit (tokens, messages, bytes) was exceeded. `field` names the request field
    that exceeded it, when one does (the API's error `param`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class JsonTooDeep(LimitExceeded):
    """A free-form JSON value to be stored is nested deeper than the limit (`dss.jsonlimits`)."""


class JsonTooLarge(LimitExceeded):
    """A free-form JSON value to be stored is larger than the limit (`dss.jsonlimits`)."""


# --- storage ------------------------------------------------------------------
class StorageError(DSSError):
    pass


class DataDirInUse(StorageError):
    """Another process owns the data directory (one store per directory)."""


class TierUnavailable(StorageError):
    """A tier cannot be used (disk full, read-only, gone). The store keeps serving from the others."""


class CorruptPage(StorageError):
    """Page bytes failed their checksum or authentication. Never served; counted and deleted."""


class CapacityError(StorageError):
    """A tier cannot make room (everything in it is pinned or in use)."""


class PageMissing(StorageError):
    """A tier does not hold the page asked for (never stored there, or deleted meanwhile)."""


# --- keys ---------------------------------------------------------------------
class KeyError_(DSSError):
    """Base for key-management errors (named with a trailing underscore to not shadow the builtin)."""


class WrongMasterKey(KeyError_):
    """The master key cannot unwrap the stored data keys. The store refuses to start."""


class MasterKeyRotated(WrongMasterKey):
    """The master key was rotated since this server read it: a data key wrapped under the old
    one could never be unwrapped after a restart, so none is stored. Restart the server with the
    new key (`dss keys rotate-master` is meant to run with every server stopped)."""


class KeyDestroyed(KeyError_):
    """The tenant's data key was destroyed by an erasure; its pages are unreadable forever."""


class StoreClosed(DSSError):
    pass


class ModelNotFound(NotFoundError):
    """A model does not exist: no usable model folder, or a request names a model not served."""


class ModelPrepareError(DSSError):
    """The default model could not be prepared from its source package."""


class ModelVerificationFailed(DSSError):
    """A prepared model did not answer the verification question correctly."""


class UnsafeSharedMemory(TierUnavailable):
    """A shared-memory directory or arena file is not private to this user (a symlink, another
    user's, open to others, not a regular file): it is never created in, attached or mapped."""


class SharedMemoryFull(TierUnavailable):
    """The shared-memory filesystem cannot hold the host arena (`host_capacity_bytes` exceeds its
    free space): the store refuses to start rather than die of SIGBUS on a later write."""


class PinnedCapExceeded(ConflictError):
    """Pinning a session would keep more bytes in the host tier than the pinned caps allow (all
    users together, or this user); nothing was changed. Unpin another session, or leave it `normal`."""


class RetentionBusy(DSSError):
    """The retention worker did not get to a session's hint within `RetentionConfig.wait_s` (busy
    with other sessions' reclassifications and demotions); the hint was withdrawn, nothing changed.
    Retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
