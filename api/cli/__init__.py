"""The `dss` command: `serve`, `keys create|list|revoke|rotate-master`, `users erase|verify`,
`model pull`.

Flags override the `DSS_*` environment (see `api.settings`). `keys` works on the database
directly (it does not need the server, and may run while the server runs), except
`keys rotate-master`, which runs only while no server owns the store. `users` opens the
store itself (the pages on disk are part of an erasure), so it needs the data directory free: with
a server running, erase through its API.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from api.settings import Settings, load_settings

if TYPE_CHECKING:
    from pydantic import BaseModel

    from dss.ops.erasure import Verification
    from dss.store import Store

main = typer.Typer(
    name="dss", help="DSS, the dialogue state store.", no_args_is_help=True, add_completion=False
)
keys_app = typer.Typer(
    help="API keys (the secret is printed once; only its hash is stored).", no_args_is_help=True
)
model_app = typer.Typer(help="The default model.", no_args_is_help=True)
users_app = typer.Typer(
    help="Erase a user and verify erasure receipts (on a data directory no server owns).",
    no_args_is_help=True,
)
main.add_typer(keys_app, name="keys")
main.add_typer(users_app, name="users")
main.add_typer(model_app, name="model")

DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data directory (SQLite metadata, disk tier, master key)")
]
DbUrlOpt = Annotated[
    str | None, typer.Option("--db-url", help="SQLAlchemy URL, e.g. postgresql+psycopg://...")
]


def _db_url(data_dir: Path | None, db_url: str | None) -> str:
    settings = _settings("dss keys", store={"data_dir": data_dir, "db_url": db_url})
    return settings.store.to_config().resolved_db_url


@main.command()
def serve(
    model: Annotated[
        Path | None, typer.Option(help="An HF model folder (default: the prepared default model)")
    ] = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000)")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error")] = None,
    no_engine: Annotated[
        bool, typer.Option("--no-engine", help="Serve the store API without a model")
    ] = False,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            "--tool-call-parser",
            help="vLLM tool-call parser for tool_choice auto, e.g. hermes (DSS_ENGINE__TOOL_CALL_PARSER)",
        ),
    ] = None,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Development mode: no API key needed, the user comes from X-DSS-User, every caller is "
            "an admin (loopback only; DSS_AUTH__DEV_MODE)",
        ),
    ] = False,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--tensor-parallel-size",
            "-tp",
            help="vLLM's tensor parallel size (DSS_ENGINE__TENSOR_PARALLEL_SIZE)",
        ),
    ] = None,
    pipeline_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--pipeline-parallel-size",
            "-pp",
            help="vLLM's pipeline parallel size (DSS_ENGINE__PIPELINE_PARALLEL_SIZE)",
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-dtype", help="vLLM's KV cache dtype, default auto (DSS_ENGINE__KV_CACHE_DTYPE)"
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option("--block-size", help="vLLM's KV cache block size in tokens (DSS_ENGINE__BLOCK_SIZE)"),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Context length in tokens, default 4096 (DSS_ENGINE__MAX_MODEL_LEN)"
        ),
    ] = None,
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-arg",
            metavar="NAME=VALUE",
            help="Any other vLLM engine argument, by its AsyncEngineArgs name (e.g. "
            "max_num_batched_tokens=8192); VALUE is JSON when it parses, else a string; repeatable; "
            "adds to DSS_ENGINE__EXTRA_ARGS",
        ),
    ] = None,
) -> None:
    """Start the OpenAI-compatible, session-aware chat server.

    It listens at once: `/healthz` answers 200, `/readyz` 503 with the reason until the store is
    open and the engine loaded. A refused start (development mode off loopback, a data directory
    another server owns, an unknown engine argument) prints one line and exits 2; a start that
    fails later exits 1.
    """
    import uvicorn

    from api.app import (
        EXIT_FAILED,
        StartupRefused,
        check_startup,
        create_app,
    )
    from api.state import Startup
    from dss.errors import DataDirInUse
    from dss.store import Store

    settings = _settings(
        "dss serve",
        server={"host": host, "port": port, "log_level": log_level},
        store={"data_dir": data_dir, "db_url": db_url},
        engine={
            "model": model,
            "enabled": False if no_engine else None,
            "tool_call_parser": tool_call_parser,
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size,
            "max_model_len": max_model_len,
        },
        auth={"dev_mode": True if dev else None},
    )
    try:
        check_startup(settings)
    except StartupRefused as exc:
        _refuse(str(exc))
    settings = _with_engine_args(settings, engine_arg or [])
    try:
        Store.ensure_data_dir_free(settings.store.to_config())
    except DataDirInUse as exc:
        _refuse(str(exc))
    level = settings.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level.lower(),
        access_log=False,  # ours (api.middleware) logs route templates, not paths with user ids
        timeout_graceful_shutdown=int(settings.server.graceful_shutdown_s),
    )
    server = uvicorn.Server(config)
    failed: list[Startup] = []

    def on_start_failure(startup: Startup) -> None:
        failed.append(startup)  # the lifespan logged it; stop serving and exit with its code
        server.should_exit = True

    app.state.listening = lambda: server.started
    app.state.on_start_failure = on_start_failure
    server.run()
    if failed:
        raise typer.Exit(failed[0].exit_code or EXIT_FAILED)


def _with_engine_args(settings: Settings, flags: list[str]) -> Settings:
    """The settings with the `--engine-arg` flags added to `DSS_ENGINE__EXTRA_ARGS` (a flag wins
    over the variable for the same name), checked against vLLM's engine arguments, and the
    parallel layout checked against this machine: a name vLLM does not know, one DSS sets itself,
    more ranks than CPUs refuse the start with one line (exit 2) before anything listens."""
    from engine_patch.setup.engine_args import (
        EngineArgumentError,
        check_engine_args,
        check_parallel_layout,
        parse_engine_arg,
    )

    eng = settings.engine
    try:
        extra = check_engine_args({**eng.extra_args, **dict(parse_engine_arg(f) for f in flags)})
        if eng.enabled and eng.tensor_parallel_size * eng.pipeline_parallel_size > 1:
            check_parallel_layout(eng.tensor_parallel_size, eng.pipeline_parallel_size, eng.enforce_eager)
    except EngineArgumentError as exc:
        _refuse(str(exc))
    if extra == eng.extra_args:
        return settings
    return settings.model_copy(update={"engine": eng.model_copy(update={"extra_args": extra})})


def _settings(command: str, **overrides: Any) -> Settings:
    """The settings, or one line per invalid value on stderr and exit 2 (no traceback): a
    `DSS_*` variable or flag the operator can fix."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        for err in exc.errors():
            where = "DSS_" + "__".join(str(part) for part in err["loc"]).upper()
            typer.echo(f"{command}: invalid setting {where}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a DSS_* variable that does not parse (bad JSON, say)
        typer.echo(f"{command}: invalid setting: {exc}", err=True)
        raise typer.Exit(2) from None


def _refuse(message: str) -> NoReturn:
    """One line on stderr and exit 2: a start refused for a reason the operator can fix."""
    typer.echo(f"dss serve: {message}", err=True)
    raise typer.Exit(2)


@keys_app.command("create")
def keys_create(
    user: Annotated[str | None, typer.Option(help="The user this key acts as")] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="May erase users, manage prefixes, read metrics")
    ] = False,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Create an API key and print it (once)."""
    from api.auth import ApiKeys
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head
    from dss.errors import InvalidInput

    if user is None and not admin:
        raise typer.BadParameter("give --user NAME, or --admin")
    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        created = ApiKeys(make_session_factory(engine)).create(user, admin=admin)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        engine.dispose()
    kind = "admin key" if created.is_admin else "key"
    typer.echo(f"created {kind} {created.id} for user {created.user!r}; it is shown only now:", err=True)
    typer.echo(created.key)


@keys_app.command("list")
def keys_list(data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """List keys (ids and owners; never the secrets)."""
    from api.auth import ApiKeys
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head

    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        for k in ApiKeys(make_session_factory(engine)).list():
            state = f"revoked {k.revoked_at:%Y-%m-%d}" if k.revoked_at else "active"
            typer.echo(f"{k.id}\t{k.user}\t{'admin' if k.is_admin else 'user'}\t{state}")
    finally:
        engine.dispose()


@keys_app.command("revoke")
def keys_revoke(key_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Revoke a key by id (a running server stops accepting it within its key cache TTL)."""
    from api.auth import ApiKeys
    from dss.db.connect import make_engine, make_session_factory, upgrade_to_head

    url = _db_url(data_dir, db_url)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        if not ApiKeys(make_session_factory(engine)).revoke(key_id):
            typer.echo(f"no active key {key_id}", err=True)
            raise typer.Exit(1)
    finally:
        engine.dispose()
    typer.echo(f"revoked {key_id}", err=True)


@keys_app.command("rotate-master")
def keys_rotate_master(
    new_key_file: Annotated[
        Path | None,
        typer.Option(
            "--new-key-file",
            help="Write the new master key to this new file (required when the key comes from "
            "DSS_MASTER_KEY); default: over the current key file",
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Re-wrap every data key and the server secret under a new master key; the old one stops
    opening the store. Offline: stop every server of the store first."""
    from dss.errors import DataDirInUse, WrongMasterKey
    from dss.keys.rotation import rotate_master

    settings = _settings("dss keys rotate-master", store={"data_dir": data_dir, "db_url": db_url})
    try:
        report = rotate_master(
            settings.store.to_config(), new_key_file.expanduser() if new_key_file else None
        )
    except (DataDirInUse, WrongMasterKey) as exc:
        typer.echo(f"dss keys rotate-master: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"re-wrapped {report.data_keys} data key(s) and the server secret; "
        f"new master key in {report.key_file}"
    )
    if report.removed_key_file is not None:
        typer.echo(f"the old key file {report.removed_key_file} was overwritten and removed", err=True)
    typer.echo("start every server of this store with the new key; the old one opens nothing now", err=True)


# Opening the store to erase makes no arena (the host tier is empty at start, and arenas are made
# on first use), but the host tier checks its capacity fits in /dev/shm: ask for little.
_CLI_HOST_CAPACITY = 16 << 20


@contextmanager
def _open_store(command: str, data_dir: Path | None, db_url: str | None) -> Iterator[Store]:
    """The store of the server's data directory, opened by this process; exit 2 with one line
    when a server owns it (the owner lock)."""
    from dss.errors import DataDirInUse
    from dss.store import Store

    settings = _settings(command, store={"data_dir": data_dir, "db_url": db_url})
    config = replace(settings.store.to_config(), host_capacity_bytes=_CLI_HOST_CAPACITY, codec_process=False)
    try:
        store = Store.open(config)
    except DataDirInUse:
        typer.echo(
            f"{command}: a running server owns the data directory {config.data_dir}; ask it instead "
            "(DELETE /v1/users/{user_id} with an admin key or the user's own, "
            "GET /v1/erasures/{receipt_id}), or stop it first",
            err=True,
        )
        raise typer.Exit(2) from None
    try:
        yield store
    finally:
        store.close()


def _print_verified(out: BaseModel, verification: Verification) -> None:
    """Print `out` as JSON; exit 1 when the verification found remnants or a broken chain."""
    typer.echo(out.model_dump_json(indent=2))
    if verification.remnants or not verification.chain_ok:
        raise typer.Exit(1)


@users_app.command("erase")
def users_erase(
    user: Annotated[str, typer.Argument(help="The user id (any id a key or request ever used)")],
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Erase everything the store holds of USER; print the verified receipt as JSON (exit 1 when
    its verification finds remnants or a broken receipt chain)."""
    from api.auth import ApiKeys
    from api.routes.users import erasable_user, receipt_out
    from dss.errors import DSSError, InvalidInput
    from dss.inputs import check_stored_user_id

    command = "dss users erase"
    try:
        check_stored_user_id(user)  # before opening anything
    except InvalidInput as exc:
        typer.echo(f"{command}: {exc}", err=True)
        raise typer.Exit(2) from None
    with _open_store(command, data_dir, db_url) as store:
        try:
            user = erasable_user(store, ApiKeys(store.sf), user)
        except InvalidInput as exc:
            typer.echo(f"{command}: {exc}", err=True)
            raise typer.Exit(2) from None
        try:
            out = receipt_out(store, store.eraser.erase_user(user))
        except DSSError as exc:
            typer.echo(f"{command}: {type(exc).__name__}: {exc}", err=True)
            raise typer.Exit(1) from None
        verification = store.eraser.verify(out.id)
    _print_verified(out, verification)


@users_app.command("verify")
def users_verify(
    receipt_id: Annotated[str, typer.Argument(help="An erasure receipt id (era_...)")],
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Verify an erasure receipt afresh and print the verification as JSON (exit 1 when it finds
    remnants or a broken receipt chain, or there is no such receipt)."""
    from api.routes.users import verification_out
    from dss.errors import DSSError

    command = "dss users verify"
    with _open_store(command, data_dir, db_url) as store:
        try:
            verification = store.eraser.verify(receipt_id)
        except DSSError as exc:
            typer.echo(f"{command}: {exc}", err=True)
            raise typer.Exit(1) from None
    _print_verified(verification_out(verification), verification)


@model_app.command("pull")
def model_pull(
    data_dir: DataDirOpt = None,
    verify: Annotated[
        bool | None,
        typer.Option("--verify/--no-verify", help="Check the model answers correctly (default: when new)"),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Verify in this dtype (default: the served one, DSS_ENGINE__DTYPE)"),
    ] = None,
) -> None:
    """Prepare the default model (SmolLM2-135M-Instruct) under DATA_DIR/models/."""
    from dss.errors import DSSError
    from engine_patch.setup.model import (
        default_data_dir,
        default_model_dir,
        is_ready,
        pull_default_model,
        verify_model,
    )

    root = (data_dir or default_data_dir()).expanduser()
    fresh = not is_ready(default_model_dir(root))
    dtype = dtype or _settings("dss model pull").engine.dtype
    if dtype not in (None, "float32", "bfloat16", "float16"):
        typer.echo(f"dss model pull: --dtype must be float32, bfloat16 or float16, not {dtype!r}", err=True)
        raise typer.Exit(2)
    try:
        path = pull_default_model(root)
        typer.echo(str(path))
        if verify if verify is not None else fresh:
            typer.echo(f"verified: {verify_model(path, dtype=dtype)}", err=True)
    except DSSError as exc:  # one line, not a traceback: the message says what failed
        typer.echo(f"dss model pull: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None


if __name__ == "__main__":
    sys.exit(main())
