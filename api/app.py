"""The app factory and its lifespan: listen first, then open the store and start the engine.

`create_app(settings)` only builds the FastAPI object. Its lifespan refuses a configuration that
must not serve (development mode off loopback) before anything listens, then starts the store
(open with migrations and recovery) and the embedded vLLM engine in a background task, so that
the server answers `/healthz` at once and `/readyz` (503, with the reason) while a CPU engine
loads for a minute; routes that need the store or the engine answer 503 with Retry-After until
then. When the server stops, the lifespan undoes what was started, in reverse order.

A start that fails in the background (the data directory taken by another process, a model that
does not load) is logged in one line and reported by `/readyz`; `dss serve` then stops and exits
non-zero (`on_start_failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import Depends, FastAPI

from api.auth import check_user_name
from api.deps import authenticate_before_body, check_request_text
from api.http_errors import UncachedModel, install_error_handlers
from api.keys.api_keys import ApiKeys
from api.keys.store_tables import StoreTables
from api.loop_lag import watch_loop_lag
from api.metrics import Metrics
from api.middleware import AuthBeforeBody, BodyLimit, DevHostGuard, RequestMetrics, ServerIdHeader
from api.routes import (
    admin,
    branches,
    chat,
    console,
    conversations,
    health,
    models,
    prefixes,
    prometheus,
    responses,
    sessions,
    users,
    versions,
)
from api.settings import Settings
from api.state import AppState, Phase, Startup, TenantAborter
from dss.errors import DataDirInUse, DSSError, InvalidInput
from dss.keys.crypto import env_master_key_set
from dss.store import Store
from engine_patch.setup.engine_args import EngineArgumentError

log = logging.getLogger("dss.api")

API_VERSION = "0.1.0"
EXIT_REFUSED = 2  # the configuration or the data directory does not allow this server to start
EXIT_FAILED = 1  # something broke while starting (the engine, the store)


class StartupRefused(DSSError):
    """The server must not start with this configuration (e.g. development mode on a public bind)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings if settings is not None else Settings()
    app = FastAPI(
        title="DSS — the dialogue state store",
        version=API_VERSION,
        description="An OpenAI-compatible, session-aware chat server: versions, rollback, branch, erase.",
        lifespan=_lifespan,
        # Before any route's own dependencies: no NUL or lone surrogate reaches a route.
        dependencies=[Depends(check_request_text)],
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.startup = Startup()
    # Set by `dss serve`: whether uvicorn listens yet, and what to do when the start fails.
    app.state.listening = None
    app.state.on_start_failure = None
    install_error_handlers(app)
    for module in (
        chat,
        responses,
        conversations,
        sessions,
        versions,
        branches,
        users,
        admin,
        prefixes,
        models,
        health,
        prometheus,
        console,
    ):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_body_bytes)
    # Outside the size limit (which reads the body): an unauthenticated body is never read.
    app.add_middleware(AuthBeforeBody, authenticate=authenticate_before_body)
    if settings.auth.dev_mode:
        app.add_middleware(DevHostGuard, extra=settings.auth.dev_allowed_hosts)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    # Outermost: every answer names its server, the middlewares' own (413, 421) included.
    app.add_middleware(ServerIdHeader, server_id=lambda: server_id_of(app))
    return app


def server_id_of(app: FastAPI) -> str | None:
    """This server's name in a fleet: the open store's (the configured one, or the one its data
    directory keeps), else the configured one while the store opens."""
    state: AppState | None = getattr(app.state, "dss", None)
    if state is not None and state.store.server_id:
        return state.store.server_id
    settings: Settings = app.state.settings
    return settings.store.server_id


def check_startup(settings: Settings) -> None:
    """Refuse what must never serve, before anything listens (`StartupRefused`, one line)."""
    auth = settings.auth
    if auth.dev_mode and not settings.server.is_loopback:
        raise StartupRefused(
            f"refusing development mode on {settings.server.host}: it serves without keys, so it binds "
            "to loopback only; use --host 127.0.0.1, or drop --dev and create keys with "
            "`dss keys create --user NAME`"
        )
    if auth.dev_mode:
        try:
            check_user_name(auth.dev_default_user)
        except InvalidInput as exc:
            raise StartupRefused(f"DSS_AUTH__DEV_DEFAULT_USER: {exc}") from None


def master_key_warning(settings: Settings) -> str | None:
    """Outside development mode, a master key file inside the data directory is worth a warning:
    a copy of the directory (a disk backup, a snapshot) then holds the key with what it protects."""
    if settings.auth.dev_mode or env_master_key_set():
        return None
    cfg = settings.store.to_config()
    key_file = cfg.resolved_key_file.expanduser().resolve()
    if not key_file.is_relative_to(cfg.data_dir.resolve()):
        return None
    return (
        f"the master key file {key_file} is inside the data directory: any copy of the directory "
        "carries the key with the data it protects; keep it elsewhere (DSS_STORE__MASTER_KEY_FILE, "
        "or DSS_MASTER_KEY from a secret manager): `dss keys rotate-master --new-key-file PATH`"
    )


def log_auth_mode(settings: Settings, keys: ApiKeys) -> None:
    if settings.auth.dev_mode:
        log.warning(
            "DEVELOPMENT MODE (--dev): requests without a dss- key are NOT authenticated; the user comes "
            "from the X-DSS-User header or the request's `user` field and every such caller is an admin. "
            "Loopback only, and only for Host headers naming localhost."
        )
    elif not keys.any_active():
        log.warning(
            "no API key exists: every request is refused (401) until one is created with "
            "`dss keys create --user NAME` (for local development without keys: `dss serve --dev`)"
        )


def refusal_of(exc: BaseException, settings: Settings) -> str | None:
    """The one line that says why the server cannot start, for failures that are a situation to
    fix rather than a bug (no traceback helps with those); None for anything else."""
    if isinstance(exc, StartupRefused | DataDirInUse | UncachedModel | EngineArgumentError):
        return str(exc)
    return None


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    check_startup(settings)
    startup: Startup = app.state.startup
    boot = asyncio.create_task(_start(app), name="dss-start")
    lag = asyncio.create_task(watch_loop_lag(app.state.metrics.loop_lag_seconds), name="dss-loop-lag")
    try:
        yield
    finally:
        lag.cancel()
        if startup.phase is not Phase.FAILED:
            startup.phase = Phase.STOPPING
        # The step in progress runs in a worker thread (store open, engine load) that a cancel
        # would not stop, only abandon with a lock or engine processes held: let it finish.
        with contextlib.suppress(Exception):
            await asyncio.shield(boot)
        await _stop(app)


async def _start(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    startup: Startup = app.state.startup
    listening: Callable[[], bool] | None = app.state.listening
    while listening is not None and not listening() and startup.phase is not Phase.STOPPING:
        await asyncio.sleep(0.02)  # uvicorn binds right after the lifespan started
    if startup.phase is Phase.STOPPING:  # stopped before it listened: open nothing
        return
    try:
        await _open(app, settings, startup)
    except Exception as exc:
        refusal = refusal_of(exc, settings)
        if refusal is not None:
            startup.error, startup.exit_code = refusal, EXIT_REFUSED
            log.error("cannot start: %s", refusal)
        else:
            startup.error, startup.exit_code = f"{type(exc).__name__}: {exc}", EXIT_FAILED
            # One line; the traceback only helps with what is not a typed store or model error.
            hint = "" if isinstance(exc, DSSError) else " (--log-level debug shows where)"
            log.debug("start-up failure", exc_info=exc)
            log.error("start-up failed: %s%s", startup.error, hint)
        startup.phase = Phase.FAILED
        on_failure: Callable[[Startup], None] | None = app.state.on_start_failure
        if on_failure is not None:
            on_failure(startup)


async def _open(app: FastAPI, settings: Settings, startup: Startup) -> None:
    metrics: Metrics = app.state.metrics
    aborter = TenantAborter(asyncio.get_running_loop())  # erasures by other servers of the fleet
    warning = master_key_warning(settings)  # before the store takes DSS_MASTER_KEY out of the environment
    # The server's processes (vLLM's engine core and workers, the page codec) never need the
    # master key: it leaves this process's environment once read, before any of them starts.
    config = replace(settings.store_config(), forget_env_master_key=True)
    store = await asyncio.to_thread(Store.open, config, aborter, StoreTables())
    try:
        auth = settings.auth
        keys = ApiKeys(
            store.sf,
            auth.key_cache_ttl_s,
            unknown_ttl_s=auth.unknown_key_cache_ttl_s,
            unknown_max=auth.unknown_key_cache_size,
            on_lookup=metrics.observe_key_lookup,
        )
        await asyncio.to_thread(log_auth_mode, settings, keys)
        if warning is not None:
            log.warning("%s", warning)
        state = AppState(settings=settings, store=store, keys=keys, metrics=metrics)
        app.state.collector = metrics.watch_store(store.stats)
    except BaseException:
        await asyncio.to_thread(store.close)
        raise
    app.state.dss = state  # from here on, routes that need only the store answer
    if startup.phase is Phase.STOPPING:
        return
    if settings.engine.enabled:
        from api.llm.startup import start_chat_engine

        startup.phase = Phase.ENGINE_STARTING
        engine = await asyncio.wait_for(start_chat_engine(settings, store), settings.engine.startup_timeout_s)
        engine.slots.on_change = metrics.inflight.set
        metrics.kv_caching.set(1 if engine.kv_caching else 0)
        engine.on_caching_change = lambda on: metrics.kv_caching.set(1 if on else 0)
        state.engine = engine
        aborter.engine = engine
    if startup.phase is Phase.STOPPING:
        return
    freeze_startup_heap()
    state.started = True
    startup.phase = Phase.READY
    log.info("DSS ready on %s:%d", settings.server.host, settings.server.port)


def freeze_startup_heap() -> None:
    """Take what start-up made (vLLM's client, torch, transformers and the tokenizer, SQLAlchemy,
    the app: some 800,000 objects) out of the garbage collector's full collections, which walked
    them all and stopped every thread of this process for 386 ms about once a minute under
    `bench/api_load.py` (issue 31; 12-18 ms since). What serving allocates is still collected;
    `_stop` gives the frozen objects back. vLLM's own server and engine core do the same
    (`vllm.utils.gc_utils.freeze_gc_heap`)."""
    gc.collect()
    gc.freeze()


async def _stop(app: FastAPI) -> None:
    state: AppState | None = getattr(app.state, "dss", None)
    if state is None:
        return
    state.started = False
    gc.unfreeze()  # a server stopped in a process that lives on (tests, embedding) is collectable
    if state.engine is not None:
        await asyncio.to_thread(state.engine.shutdown)
        state.engine = None
    collector = getattr(app.state, "collector", None)
    if collector is not None:
        state.metrics.registry.unregister(collector)
        app.state.collector = None
    state.short_db.shutdown(wait=True)
    await asyncio.to_thread(state.store.close)
    del app.state.dss
