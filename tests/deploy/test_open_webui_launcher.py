"""`deploy/open_webui.py`'s launcher (issue 28, item 8), without installing Open WebUI: the
frontend key comes from a file or `DSS_FRONTEND_KEY`, not the command line (visible in `ps`),
and Open WebUI's data directory is private (`0700`, outside DSS's own data directory) with Open
WebUI writing its files under umask `077`.

Before the fix the key could only be given as `--api-key` and the data directory was created
with the umask (`0755`) inside `~/.local/share/dss`."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deploy.open_webui as launcher

KEY = "dss-frontend-secret-for-the-test"
KEY_ENV = "DSS_FRONTEND_KEY"


class Ran:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        self.calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Ran]:
    run = Ran()
    monkeypatch.setattr(
        launcher, "ensure_open_webui", lambda home=None, log=None: tmp_path / "bin" / "open-webui"
    )
    monkeypatch.setattr(launcher.subprocess, "run", run)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    old = os.umask(0o022)  # a common umask: the directory must be private all the same
    try:
        yield run
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_key_comes_from_a_file_and_the_data_directory_is_private(ran: Ran, tmp_path: Path) -> None:
    key_file = tmp_path / "frontend.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    assert launcher.main(["--dss-url", "http://127.0.0.1:8000", "--api-key-file", str(key_file)]) == 0
    (cmd, kwargs) = ran.calls[-1]
    assert KEY not in " ".join(cmd)
    assert kwargs["env"]["OPENAI_API_KEY"] == KEY
    assert kwargs["umask"] == 0o077  # Open WebUI's own files: 0600
    data = Path(kwargs["env"]["DATA_DIR"])
    dss_data = tmp_path / "home" / ".local" / "share" / "dss"
    assert not data.is_relative_to(dss_data)
    assert _mode(data) == 0o700
    assert _mode(data / "secret.key") == 0o600


def test_the_key_comes_from_the_environment_and_an_existing_directory_is_made_private(
    ran: Ran, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    data = tmp_path / "owui"
    data.mkdir(mode=0o755)
    assert launcher.main(["--dss-url", "http://127.0.0.1:8000", "--data-dir", str(data)]) == 0
    (cmd, kwargs) = ran.calls[-1]
    assert KEY not in " ".join(cmd)
    assert kwargs["env"]["OPENAI_API_KEY"] == KEY and KEY_ENV not in kwargs["env"]
    assert _mode(data) == 0o700


def test_a_key_on_the_command_line_is_taken_with_a_warning(
    ran: Ran, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["--dss-url", "http://127.0.0.1:8000", "--api-key", KEY]) == 0
    assert "visible" in capsys.readouterr().err
    assert ran.calls[-1][1]["env"]["OPENAI_API_KEY"] == KEY
    with pytest.raises(SystemExit):  # no key at all
        launcher.main(["--dss-url", "http://127.0.0.1:8000"])
