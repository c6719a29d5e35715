"""Master key loading, data-key wrapping, verifier and page encryption."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dss.errors import CorruptPage, WrongMasterKey
from dss.keys import crypto
from dss.keys.crypto import KeyManager

ENV = "DSS_TEST_MASTER_KEY"  # a private env var name, so the real one never leaks into tests


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def write_key(path: Path, key: bytes, mode: int = 0o600) -> None:
    path.write_text(key.hex() + "\n")
    path.chmod(mode)


def test_create_if_missing_writes_0600_file_and_reloads(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "master.key"
    km = KeyManager.load(path, env_var=ENV, create_if_missing=True)
    assert km.generated and km.source == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(bytes.fromhex(path.read_text())) == 32
    assert [p.name for p in path.parent.iterdir()] == ["master.key"]  # no temp file left
    again = KeyManager.load(path, env_var=ENV, create_if_missing=True)
    assert not again.generated
    assert again.unwrap(km.wrap(b"k" * 32, "t"), "t") == b"k" * 32


def test_missing_key_names_its_sources(tmp_path: Path) -> None:
    path = tmp_path / "absent.key"
    with pytest.raises(WrongMasterKey, match=f"{ENV}.*{path}"):
        KeyManager.load(path, env_var=ENV)
    with pytest.raises(WrongMasterKey, match=ENV):
        KeyManager.load(None, env_var=ENV, create_if_missing=True)


def test_env_wins_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "master.key"
    write_key(path, b"\x01" * 32)
    from_file = KeyManager.load(path, env_var=ENV)
    monkeypatch.setenv(ENV, (b"\x02" * 32).hex())
    from_env = KeyManager.load(path, env_var=ENV)
    assert from_env.source == f"env {ENV}" and from_file.source == str(path)
    wrapped = from_env.wrap(b"d" * 32, "tenant-a")
    with pytest.raises(WrongMasterKey, match=str(path)):
        from_file.unwrap(wrapped, "tenant-a")


@pytest.mark.parametrize("text", ["", "zz" * 32, "ab" * 31, "ab" * 33, "not a key"])
def test_malformed_key_names_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "master.key"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(WrongMasterKey, match="malformed.*" + str(path)):
        KeyManager.load(path, env_var=ENV)
    if text:
        monkeypatch.setenv(ENV, text)
        with pytest.raises(WrongMasterKey, match=f"malformed.*env {ENV}"):
            KeyManager.load(path, env_var=ENV)


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    write_key(path, b"\x03" * 32, mode=0o644)
    with pytest.raises(WrongMasterKey, match="0644"):
        KeyManager.load(path, env_var=ENV)


def test_wrap_is_bound_to_tenant_and_key() -> None:
    km = KeyManager(b"\x05" * 32, "test")
    data_key = km.new_data_key()
    assert len(data_key) == 32 and data_key != km.new_data_key()
    wrapped = km.wrap(data_key, "alice")
    assert wrapped != km.wrap(data_key, "alice")  # fresh nonce every time
    assert km.unwrap(wrapped, "alice") == data_key
    with pytest.raises(WrongMasterKey, match="test"):
        km.unwrap(wrapped, "bob")
    tampered = bytearray(wrapped)
    tampered[20] ^= 1
    with pytest.raises(WrongMasterKey):
        km.unwrap(bytes(tampered), "alice")
    with pytest.raises(WrongMasterKey):
        km.unwrap(wrapped[:-1], "alice")


def test_verifier_detects_wrong_master_key() -> None:
    right = KeyManager(b"\x06" * 32, "file A")
    wrong = KeyManager(b"\x07" * 32, "env B")
    verifier = right.make_verifier()
    right.check_verifier(verifier)
    with pytest.raises(WrongMasterKey, match="env B"):
        wrong.check_verifier(verifier)
    with pytest.raises(WrongMasterKey):
        right.check_verifier(verifier[:-1])
    with pytest.raises(WrongMasterKey):
        right.check_verifier(b"")
    assert "\\x06" not in repr(right) and "06" * 4 not in repr(right)


def test_encrypt_decrypt_and_tamper() -> None:
    key = os.urandom(32)
    plain = os.urandom(10_000)
    blob = crypto.encrypt(key, plain, b"header")
    assert len(blob) == len(plain) + crypto.NONCE_BYTES + crypto.TAG_BYTES
    assert crypto.decrypt(key, blob, b"header") == plain
    assert crypto.decrypt(key, memoryview(blob), b"header") == plain
    for pos in (0, 11, 12, 5000, len(blob) - 1):  # nonce, ciphertext, tag
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptPage):
            crypto.decrypt(key, bytes(bad), b"header")
    with pytest.raises(CorruptPage):
        crypto.decrypt(key, blob, b"other header")
    with pytest.raises(CorruptPage):
        crypto.decrypt(os.urandom(32), blob, b"header")
    with pytest.raises(CorruptPage):
        crypto.decrypt(key, blob[:20], b"header")
