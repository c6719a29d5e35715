"""Encryption at rest: the master key, per-tenant data keys and AES-GCM.

The master key (32 bytes, hex in env `DSS_MASTER_KEY` or in a 0600 key file) only wraps data
keys; pages are encrypted under their tenant's data key. Erasing a tenant destroys its wrapped
data key in the database, which makes every page of that tenant unreadable at once, wherever
copies of the files went (crypto-shredding).

The master key rotates (`dss.ops.key_changes.master_rotation`): every wrapped key is re-wrapped
under a new one and the old key file is overwritten. The new key is first written next to the
file as a pending key (`pending_key_path`), so a rotation killed after its commit is finished by
the next `load_master_key`, never leaving a store that no key opens.

Nonces are 96 random bits per message. NIST SP 800-38D allows 2**32 messages per key with random
nonces; a data key encrypts one tenant's pages, far below that.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dss.errors import CorruptPage, WrongMasterKey
from dss.files import fsync_dir
from dss.types import Buffer

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
DEFAULT_ENV_VAR = "DSS_MASTER_KEY"

_WRAP_AAD = b"dss-data-key\x00"
_VERIFIER_AAD = b"dss-master-key-verifier\x00"
_VERIFIER_PLAINTEXT = b"DSS master key verifier v1"


def _parse_hex_key(text: str, source: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise WrongMasterKey(
            f"malformed master key in {source}: expected {2 * KEY_BYTES} hex characters, got {len(text)}"
        )
    return key


class KeyManager:
    """Holds the master key; wraps and unwraps tenant data keys under it."""

    def __init__(
        self, master_key: bytes, source: str, generated: bool = False, file: Path | None = None
    ) -> None:
        if len(master_key) != KEY_BYTES:
            raise WrongMasterKey(f"master key from {source} must be {KEY_BYTES} bytes")
        self._aead = AESGCM(master_key)
        self.source = source
        self.generated = generated
        self.file = file  # the key file it was read from; None: the environment

    def __repr__(self) -> str:  # never print key material
        return f"KeyManager(source={self.source!r}, generated={self.generated})"

    @classmethod
    def load(
        cls, key_file: Path | None, env_var: str = DEFAULT_ENV_VAR, create_if_missing: bool = False
    ) -> KeyManager:
        """The env var wins over the file; a missing key is generated only when asked to."""
        env_value = os.environ.get(env_var)
        if env_value:
            source = f"env {env_var}"
            return cls(_parse_hex_key(env_value, source), source)
        if key_file is not None:
            key_file = Path(key_file)
            if key_file.exists():
                return cls(_read_key_file(key_file), str(key_file), file=key_file)
            if create_if_missing:
                return cls(_create_key_file(key_file), str(key_file), generated=True, file=key_file)
            raise WrongMasterKey(
                f"no master key: env {env_var} is unset and key file {key_file} does not exist"
            )
        raise WrongMasterKey(f"no master key: env {env_var} is unset and no key file is configured")

    @classmethod
    def from_file(cls, path: Path) -> KeyManager:
        """The key in `path` alone (the environment is not consulted)."""
        return cls(_read_key_file(path), str(path), file=path)

    def new_data_key(self) -> bytes:
        return secrets.token_bytes(KEY_BYTES)

    def wrap(self, data_key: bytes, tenant: str) -> bytes:
        if len(data_key) != KEY_BYTES:
            raise ValueError(f"data keys are {KEY_BYTES} bytes")
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data_key, _WRAP_AAD + tenant.encode())

    def unwrap(self, wrapped: bytes, tenant: str) -> bytes:
        if len(wrapped) != NONCE_BYTES + KEY_BYTES + TAG_BYTES:
            raise WrongMasterKey(f"wrapped data key of tenant {tenant} has a wrong length ({len(wrapped)} B)")
        try:
            return self._aead.decrypt(
                wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], _WRAP_AAD + tenant.encode()
            )
        except InvalidTag:
            raise WrongMasterKey(
                f"the master key from {self.source} cannot unwrap the data key of tenant {tenant}"
            ) from None

    def make_verifier(self) -> bytes:
        """An encrypted constant to store once; `check_verifier` then detects a wrong master key."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, _VERIFIER_PLAINTEXT, _VERIFIER_AAD)

    def check_verifier(self, verifier: bytes) -> None:
        try:
            plain = self._aead.decrypt(verifier[:NONCE_BYTES], verifier[NONCE_BYTES:], _VERIFIER_AAD)
        except (InvalidTag, ValueError):
            plain = b""
        if plain != _VERIFIER_PLAINTEXT:
            raise WrongMasterKey(
                f"the master key from {self.source} is not the key this store was created with"
            )


def forget_env_master_key(env_var: str = DEFAULT_ENV_VAR) -> None:
    """Remove the master key from this process's environment (`unsetenv` too), once it is read:
    every process started afterwards (a server's engine and its workers, the page codec) would
    inherit it, and none of them needs it. `/proc/<pid>/environ` of this process still shows the
    environment it was started with (to its owner and root only)."""
    os.environ.pop(env_var, None)


def env_master_key_set(env_var: str = DEFAULT_ENV_VAR) -> bool:
    """Whether the master key comes from the environment (it wins over any key file)."""
    return bool(os.environ.get(env_var))


def pending_key_path(key_file: Path) -> Path:
    """Where a rotation keeps the new key until the old file is overwritten with it."""
    return key_file.with_name(f".{key_file.name}.rotating")


def new_key_file(path: Path) -> bytes:
    """A fresh key in a new 0600 file (refused if `path` exists), durable before it returns."""
    key = secrets.token_bytes(KEY_BYTES)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (key.hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(path.parent)
    except FileExistsError:
        raise WrongMasterKey(
            f"{path} already exists: a new master key is never written over a file"
        ) from None
    except OSError as exc:
        raise WrongMasterKey(f"cannot write master key file {path}: {exc.strerror or exc}") from exc
    return key


def overwrite_key_file(path: Path, key: bytes) -> None:
    """Write `key` over the existing file's bytes in place (same length: on a file system that
    writes in place, the old key's blocks are overwritten, not just unlinked), then fsync."""
    text = (key.hex() + "\n").encode()
    fd = os.open(path, os.O_WRONLY)  # through a symlink too: the key was read through it
    try:
        os.fchmod(fd, 0o600)
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))
        os.fsync(fd)
    finally:
        os.close(fd)


def install_pending_key(key_file: Path) -> None:
    """The last step of a rotation (or of its completion at the next open): the pending key
    replaces the key file's content, then the pending file goes."""
    pending = pending_key_path(key_file)
    key = _read_key_file(pending)
    if key_file.exists():
        overwrite_key_file(key_file, key)
    else:
        os.link(pending, key_file)
    os.unlink(pending)
    fsync_dir(key_file.parent)


def finish_rotation(key_file: Path, verifier: bytes) -> KeyManager | None:
    """A rotation killed after its commit left the new key pending: if it opens the store
    (`verifier`), install it and return it; None when there is nothing to finish."""
    pending = pending_key_path(key_file)
    if not pending.exists():
        return None
    keys = KeyManager.from_file(pending)
    keys.check_verifier(verifier)
    install_pending_key(key_file)
    return KeyManager.from_file(key_file)


def destroy_key_file(path: Path) -> None:
    """Overwrite a key file with zeros, fsync, unlink (best effort against the blocks staying)."""
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0" * max(os.fstat(fd).st_size, 2 * KEY_BYTES + 1), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
        fsync_dir(path.parent)


def _read_key_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise WrongMasterKey(f"cannot read master key file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Like ssh: a key others can read is a key that has leaked.
        raise WrongMasterKey(
            f"master key file {path} has mode {stat.S_IMODE(mode):04o}; it must be 0600 (chmod 600 {path})"
        )
    return _parse_hex_key(text, str(path))


def _create_key_file(path: Path) -> bytes:
    """Write a fresh key atomically; if another process created one meanwhile, use theirs."""
    key = secrets.token_bytes(KEY_BYTES)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.write(fd, (key.hex() + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            # link() fails if the name exists, unlike rename(): two first starts cannot each keep a key.
            os.link(tmp, path)
        except FileExistsError:
            return _read_key_file(path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(path.parent)
    except OSError as exc:
        raise WrongMasterKey(f"cannot create master key file {path}: {exc.strerror or exc}") from exc
    return key


def encrypt(data_key: bytes, plaintext: Buffer, aad: bytes) -> bytes:
    """nonce ‖ ciphertext ‖ tag."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(data_key).encrypt(nonce, plaintext, aad)


def cipher(data_key: bytes) -> AESGCM:
    """A data key's cipher, for callers that open many small values under one key (setting up
    the key schedule costs more than opening a 64-byte value)."""
    return AESGCM(data_key)


def decrypt(data_key: bytes | AESGCM, blob: Buffer, aad: bytes) -> bytes:
    """Raises `CorruptPage` when authentication fails: damaged bytes, or a wrong/destroyed key."""
    view = memoryview(blob)
    if len(view) < NONCE_BYTES + TAG_BYTES:
        raise CorruptPage(f"encrypted blob too short ({len(view)} B)")
    aead = data_key if isinstance(data_key, AESGCM) else AESGCM(data_key)
    try:
        return aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], aad)
    except InvalidTag:
        raise CorruptPage("page failed authentication (damaged, or encrypted under another key)") from None
