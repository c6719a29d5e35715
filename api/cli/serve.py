"""`dss serve`: the settings from flags over `DSS_*`, the start-up checks that refuse with one line
and exit 2 (development mode off loopback, a data directory another server owns, an unknown engine
argument, more parallel ranks than CPUs), then uvicorn with the app."""

from __future__ import annotations

import faulthandler
import logging
import signal
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from api.cli.common import DataDirOpt, DbUrlOpt, settings_or_exit
from api.settings import Settings


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
    from api.connections import guarded_protocol
    from api.state import Startup
    from dss.errors import DataDirInUse
    from dss.store import Store

    settings = settings_or_exit(
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
    # `kill -USR1 <pid>` writes every thread's stack to stderr (the server's log): what a server
    # that stopped answering is waiting for, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    srv = settings.server
    config = uvicorn.Config(
        app,
        host=srv.host,
        port=srv.port,
        log_level=srv.log_level.lower(),
        access_log=False,  # ours (api.middleware) logs route templates, not paths with user ids
        timeout_graceful_shutdown=int(srv.graceful_shutdown_s),
        # Bounds on a slow request head and on a response nobody reads (api.connections).
        http=guarded_protocol(srv.header_timeout_s, srv.send_timeout_s, app.state.metrics.observe_cut),
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


def _refuse(message: str) -> NoReturn:
    """One line on stderr and exit 2: a start refused for a reason the operator can fix."""
    typer.echo(f"dss serve: {message}", err=True)
    raise typer.Exit(2)
