"""Open WebUI in front of `dss serve`: its own virtual environment, installed once, and the
settings that make it one DSS frontend (docs/frontends.md, "Open WebUI", explains each).

    DSS_FRONTEND_KEY=dss-... .venv/bin/python deploy/open_webui.py --dss-url http://127.0.0.1:8000

installs Open WebUI on first use and serves it. The frontend key (it acts for every end user)
comes from `DSS_FRONTEND_KEY` or a file (`--api-key-file`) rather than the command line, which
every local account can read (`ps`); `--api-key` is still taken, with a warning. Open WebUI's
data directory (its database: every person's chats) is created `0700` outside DSS's own data
directory, and Open WebUI runs under umask `077`, so the files it writes there are `0600`.
tests/api/test_open_webui.py starts it with the same `ensure_open_webui` and `open_webui_env`,
so the test exercises the configuration shipped here.

The environment lives outside the checkout, beside the prepared model
(`$DSS_CACHE/open-webui-<version>`, default `~/.cache/dss`), so a fresh clone installs it once
per machine. It holds Open WebUI's wheel without its dependencies plus the wheel's own
`requirements-slim.txt` (what its slim Docker image installs): no torch, no
sentence-transformers, no vector database — DSS's model is the only model, and retrieval is off.

Invariants: a finished environment has the file `COMPLETE` in it, written last, so an interrupted
install never looks finished (the next call starts it over); two processes installing at once
serialise on a lock file beside it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "OPEN_WEBUI_VERSION",
    "OpenWebUIError",
    "default_home",
    "ensure_open_webui",
    "open_webui_env",
]

OPEN_WEBUI_VERSION = "0.12.4"
_COMPLETE = "COMPLETE"
_INSTALL_TIMEOUT_S = 1200.0


class OpenWebUIError(RuntimeError):
    """Open WebUI could not be installed (the message holds pip's last lines)."""


def default_home() -> Path:
    cache = Path(os.environ.get("DSS_CACHE") or Path.home() / ".cache" / "dss")
    return cache / f"open-webui-{OPEN_WEBUI_VERSION}"


def ensure_open_webui(home: Path | None = None, *, log: Path | None = None) -> Path:
    """The `open-webui` executable of the environment at `home`, installed there first when
    it is not (about a minute and a half and 0.8 GB; pip's output goes to `log`)."""
    home = home or default_home()
    exe = home / "bin" / "open-webui"
    if (home / _COMPLETE).exists():
        return exe
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now
        if not (home / _COMPLETE).exists():
            _install(home, log)
    return exe


def _install(home: Path, log: Path | None) -> None:
    shutil.rmtree(home, ignore_errors=True)  # an environment without COMPLETE is a broken one
    began = time.monotonic()
    _run([_base_python(), "-m", "venv", str(home)], log)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "-q", "--no-input"]
    # The wheel without its dependencies (its full list pulls torch, chromadb, transformers ...),
    # then the slim list the wheel ships for its slim image.
    _run([*pip, "--no-deps", f"open-webui=={OPEN_WEBUI_VERSION}"], log)
    slim = next((home / "lib").glob("python3*/site-packages/requirements-slim.txt"), None)
    if slim is None:
        raise OpenWebUIError(f"open-webui {OPEN_WEBUI_VERSION} ships no requirements-slim.txt")
    _run([*pip, "-r", str(slim)], log)
    (home / _COMPLETE).write_text(f"open-webui {OPEN_WEBUI_VERSION} in {time.monotonic() - began:.0f} s\n")


def _base_python() -> str:
    """The interpreter to make the environment with: this one's base, not the DSS environment's
    `python` (which `make clean` removes, and the environment's link would dangle)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def _run(cmd: list[str], log: Path | None) -> None:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        done = subprocess.run(
            cmd, stdout=out, stderr=subprocess.PIPE, timeout=_INSTALL_TIMEOUT_S, check=False
        )
    finally:
        if log is not None and not isinstance(out, int):
            out.close()
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-15:]
        raise OpenWebUIError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n" + "\n".join(tail))


def open_webui_env(
    *,
    dss_url: str,
    api_key: str,
    data_dir: Path,
    secret_key: str,
    model: str | None = None,
    user_header: str = "X-OpenWebUI-User-Id",
    chat_header: str = "X-OpenWebUI-Chat-Id",
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Open WebUI's environment as one DSS frontend: DSS is its only model server (one
    OpenAI-compatible connection, `api_key` a DSS frontend key), each request names its end user
    and chat in headers DSS's frontend key trusts (`user_header`, `chat_header`), nothing leaves
    the machine, and no side request (titles, tags, follow-ups, autocomplete, query generation)
    lands in a user's chats."""
    env = dict(os.environ if base is None else base)
    if model is not None:
        env["DEFAULT_MODELS"] = model  # preselected in a new chat
    env.update(
        {
            "DATA_DIR": str(data_dir),
            "WEBUI_SECRET_KEY": secret_key,
            "WEBUI_AUTH": "true",
            # These settings on every start (else the first start's are kept in its database).
            "ENABLE_PERSISTENT_CONFIG": "false",
            "DEFAULT_USER_ROLE": "user",  # a signup may chat at once (else it waits as "pending")
            # DSS's model for every user (else a connection's models are the admins' alone).
            "BYPASS_MODEL_ACCESS_CONTROL": "true",
            # DSS is the one model server.
            "ENABLE_OLLAMA_API": "false",
            "ENABLE_OPENAI_API": "true",
            "OPENAI_API_BASE_URL": dss_url.rstrip("/") + "/v1",
            "OPENAI_API_KEY": api_key,
            # Who and which chat, on every request to DSS.
            "ENABLE_FORWARD_USER_INFO_HEADERS": "true",
            "FORWARD_USER_INFO_HEADER_USER_ID": user_header,
            "FORWARD_SESSION_INFO_HEADER_CHAT_ID": chat_header,
            # Side requests would be turns of their own in the user's namespace; off.
            "ENABLE_TITLE_GENERATION": "false",
            "ENABLE_TAGS_GENERATION": "false",
            "ENABLE_FOLLOW_UP_GENERATION": "false",
            "ENABLE_AUTOCOMPLETE_GENERATION": "false",
            "ENABLE_SEARCH_QUERY_GENERATION": "false",
            "ENABLE_RETRIEVAL_QUERY_GENERATION": "false",
            # Built-in tools (memory, notes, knowledge ...) would add `tools` to every request;
            # `usage` asks for the token counts (`stream_options.include_usage`), cached ones too.
            "DEFAULT_MODEL_METADATA": json.dumps({"capabilities": {"builtin_tools": False, "usage": True}}),
            # The slim install, offline: no embedding model, no vector database, no update check.
            "USE_SLIM_DOCKER": "true",
            "OFFLINE_MODE": "true",
            "HF_HUB_OFFLINE": "1",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
            "ENABLE_VERSION_UPDATE_CHECK": "false",
        }
    )
    return env


KEY_ENV = "DSS_FRONTEND_KEY"


def default_data_dir() -> Path:
    """Open WebUI's data directory: beside DSS's (`~/.local/share/dss`), not inside it."""
    return Path.home() / ".local" / "share" / "dss-open-webui"


def _frontend_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The frontend key: `--api-key-file`, else `$DSS_FRONTEND_KEY`, else `--api-key` (warned:
    a command line is visible to every local account)."""
    if args.api_key_file is not None:
        path: Path = args.api_key_file
        if path.stat().st_mode & 0o077:
            print(f"warning: {path} is readable by other accounts; chmod 600 it", file=sys.stderr)
        key = path.read_text().strip()
        if not key:
            parser.error(f"{path} holds no key")
        return key
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV].strip()
    if args.api_key:
        print(
            f"warning: --api-key is visible to every local account (ps); use {KEY_ENV} or --api-key-file",
            file=sys.stderr,
        )
        return str(args.api_key)
    return None


def private_dir(path: Path) -> Path:
    """`path`, created if missing, `0700` (also when it existed: it holds every person's chats)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dss-url", help="`dss serve`'s base URL (without /v1)")
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"a file holding the DSS frontend key (else ${KEY_ENV})",
    )
    parser.add_argument("--api-key", help=f"the frontend key itself: visible in `ps`, prefer ${KEY_ENV}")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--home", type=Path, default=None, help="where its environment lives")
    parser.add_argument(
        "--install-only", action="store_true", help="install its environment (if missing) and exit"
    )
    args = parser.parse_args(argv)
    exe = ensure_open_webui(args.home)
    if args.install_only:
        return 0
    api_key = _frontend_key(args, parser)
    if not args.dss_url or not api_key:
        parser.error(f"--dss-url and a frontend key (${KEY_ENV} or --api-key-file) are needed to serve")
    private_dir(args.data_dir)
    secret = args.data_dir / "secret.key"
    if not secret.exists():  # private from its first byte (a chmod after writing leaves a window)
        with os.fdopen(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(os.urandom(24).hex())
    env = open_webui_env(
        dss_url=args.dss_url,
        api_key=api_key,
        data_dir=args.data_dir,
        secret_key=secret.read_text().strip(),
    )
    env.pop(KEY_ENV, None)  # Open WebUI gets the key as OPENAI_API_KEY only
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(args.port)]
    # umask 077: what Open WebUI writes (its database, uploads, caches) is its owner's alone.
    return subprocess.run(cmd, env=env, check=False, umask=0o077).returncode


if __name__ == "__main__":
    raise SystemExit(main())
