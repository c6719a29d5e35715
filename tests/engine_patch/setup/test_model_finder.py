"""One way to find the default model: `engine_patch.setup.model.find_model`, used by the CLI
(`resolve_model`), the benches (`bench/_procs.model_dir`) and the tests (`tests/api_server.model_dir`,
`tests/engine_helpers.model_path`). `make model` prepares `~/.cache/dss`; a bench run by hand
afterwards must find it there, and no bench may look for the model some other way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine_patch.connector.fingerprint import READY_MARKER
from engine_patch.setup.model import NOT_PREPARED, default_model_dir, find_model, resolve_model
from tests.paths import REPO


def fake_model(folder: Path, ready: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    if ready:
        (folder / READY_MARKER).write_text("{}")
    return folder


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No `DSS_MODEL_DIR`, a data dir and a home of the test's own."""
    monkeypatch.delenv("DSS_MODEL_DIR", raising=False)
    monkeypatch.setenv("DSS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_the_default_data_dir_is_the_checkouts_ignored_dss_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `DSS_DATA_DIR`, `<repo>/.dss`, which git ignores. Before, it resolved to
    `engine_patch/.dss` (one level short since the module moved into `engine_patch/setup/`): a model
    pulled there by a test run without `DSS_MODEL_DIR` showed up as 270 MB of untracked files."""
    from engine_patch.setup.model import default_data_dir

    monkeypatch.delenv("DSS_DATA_DIR", raising=False)
    assert default_data_dir() == REPO / ".dss"
    assert "/.dss/" in (REPO / ".gitignore").read_text().splitlines()


def test_nothing_prepared_is_none(clean_env: Path) -> None:
    assert find_model() is None
    with pytest.raises(SystemExit, match=re.escape(NOT_PREPARED)):
        bench_model_dir()


def test_make_models_cache_is_found(clean_env: Path) -> None:
    """`make model` prepares `~/.cache/dss/models/<name>`: the CLI, benches and tests find it."""
    prepared = fake_model(default_model_dir(clean_env / "home" / ".cache" / "dss"))
    assert find_model() == prepared
    assert bench_model_dir() == prepared
    assert resolve_model(None, clean_env / "server-data", pull=False) == prepared


def test_server_data_dir_then_dss_data_dir_come_first(clean_env: Path) -> None:
    fake_model(default_model_dir(clean_env / "home" / ".cache" / "dss"))
    in_data = fake_model(default_model_dir(clean_env / "data"))
    assert find_model() == in_data
    in_server = fake_model(default_model_dir(clean_env / "server"))
    assert find_model(clean_env / "server") == in_server


def test_unready_default_folder_is_not_served(clean_env: Path) -> None:
    fake_model(default_model_dir(clean_env / "data"), ready=False)
    assert find_model() is None


def test_dss_model_dir_wins_and_may_be_any_hf_folder(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_model(default_model_dir(clean_env / "data"))
    mine = fake_model(clean_env / "my-model", ready=False)
    monkeypatch.setenv("DSS_MODEL_DIR", str(mine))
    assert find_model() == mine.resolve() == bench_model_dir()
    monkeypatch.setenv("DSS_MODEL_DIR", str(clean_env / "still-being-prepared"))
    assert find_model() is None


def bench_model_dir() -> Path:
    from bench._procs import model_dir

    return model_dir()


# A bench or test that reads `DSS_MODEL_DIR`, checks the ready marker or spells the default model's
# folder (a path, not the served name) finds the model its own way; it must ask `find_model`
# (through `bench/_procs.model_dir` or `tests/api_server.model_dir`) instead.
OWN_WAY = re.compile(
    r"environ(?:\.get\(|\[)\s*[\"']DSS_MODEL_DIR|\.dss-ready|/\s*[\"']SmolLM2-135M-Instruct|models/SmolLM2"
)
OWN_WAY_ALLOWED = {
    "tests/engine_patch/setup/test_model_finder.py",
    "tests/engine_helpers.py",
    "tests/engine_patch/setup/test_model_pull.py",
}


def test_no_bench_or_test_finds_the_model_its_own_way() -> None:
    offenders = []
    for path in sorted([*REPO.glob("bench/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("deploy/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel in OWN_WAY_ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if OWN_WAY.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "find the model with engine_patch.setup.model.find_model:\n" + "\n".join(offenders)
