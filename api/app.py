"""The app factory and its lifespan: open the store, check the auth mode, start the engine.

`create_app(settings)` only builds the FastAPI object; the lifespan does the work when the server
starts (store open with migrations and recovery, refusal to serve a non-loopback address without
API keys, the embedded vLLM engine), and undoes it in reverse order when it stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.auth import ApiKeys
from api.errors import install_error_handlers
from api.metrics import Metrics
from api.middleware import BodyLimit, RequestMetrics
from api.routes import branches, chat, health, metrics, models, prefixes, sessions, users, versions
from api.settings import Settings
from api.state import AppState
from dss.errors import DSSError
from dss.store import Store

log = logging.getLogger("dss.api")

API_VERSION = "0.1.0"


class StartupRefused(DSSError):
    """The server must not start with this configuration (e.g. public bind without API keys)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings if settings is not None else Settings()
    app = FastAPI(
        title="DSS — the dialogue state store",
        version=API_VERSION,
        description="An OpenAI-compatible, session-aware chat server: versions, rollback, branch, erase.",
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    install_error_handlers(app)
    for module in (chat, sessions, versions, branches, users, prefixes, models, health, metrics):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app


def check_auth_mode(settings: Settings, keys: ApiKeys) -> bool:
    """True for development mode; refuses a non-loopback bind without any API key."""
    if keys.any_active():
        return False
    if not settings.server.is_loopback:
        raise StartupRefused(
            f"refusing to serve on {settings.server.host} without API keys: create one with "
            "`dss keys create --user NAME` (or bind to 127.0.0.1 for local development)"
        )
    if not settings.auth.allow_dev_mode:
        raise StartupRefused("no API key exists and development mode is disabled (DSS_AUTH__ALLOW_DEV_MODE)")
    log.warning(
        "DEVELOPMENT MODE: no API key is configured, so requests are NOT authenticated; the user comes "
        "from the X-DSS-User header or the request's `user` field and every caller is an admin. "
        "This is only allowed on loopback; create a key with `dss keys create --user NAME`."
    )
    return True


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    metrics: Metrics = app.state.metrics
    store = await asyncio.to_thread(Store.open, settings.store.to_config())
    state: AppState | None = None
    collector = None
    try:
        keys = ApiKeys(store.sf, settings.auth.key_cache_ttl_s)
        check_auth_mode(settings, keys)
        state = AppState(settings=settings, store=store, keys=keys, metrics=metrics)
        collector = metrics.watch_store(store.stats)
        app.state.dss = state
        if settings.engine.enabled:
            from api.engine import ChatEngine

            engine = await asyncio.wait_for(
                ChatEngine.start(settings, store), settings.engine.startup_timeout_s
            )
            engine.on_inflight_change = metrics.inflight.set
            state.engine = engine
        state.started = True
        log.info("DSS serving on %s:%d", settings.server.host, settings.server.port)
        yield
    finally:
        if state is not None:
            state.started = False
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)
                state.engine = None
        if collector is not None:
            metrics.registry.unregister(collector)
        await asyncio.to_thread(store.close)
