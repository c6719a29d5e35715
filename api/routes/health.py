"""Liveness (`/healthz`: the process answers) and readiness (`/readyz`: store open, engine ready).

The server listens before its store is open and its engine loaded, so `/healthz` answers 200 from
the first moment and `/readyz` answers 503 with a `reason` ("store opening", "engine starting",
"start-up failed: ...", "engine not healthy", "shutting down") until it can serve chats.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.shapes.resources import Health
from api.state import AppState, Phase, Startup

router = APIRouter(tags=["health"])


class Readiness(Health):
    reason: str | None = None  # why not ready; absent when ready
    # Whether DSS caches the running engine's KV (false: served as plain vLLM, allowed by
    # DSS_ENGINE__ALLOW_UNCACHED); absent until the engine runs, and without an engine.
    kv_caching: bool | None = None
    uncached_reason: str | None = None  # why not, when kv_caching is false


def _tier_health(state: AppState) -> dict[str, str]:
    """Tiers a server serves without: the disk tier, and the fleet's remote tier when configured.
    Neither makes the server unready (no client request fails for them)."""
    pages = state.store.pages
    out = {"disk": "ok" if pages.disk_available else "unavailable"}
    if pages.remote is not None:
        # An unavailable tier is asked again (a PING, at most every few seconds): /readyz tells
        # when Redis is back even while no traffic reaches it.
        up = pages.remote.available or pages.remote.probe()
        out["remote"] = "ok" if up else "unavailable"
    return out


@router.get("/healthz", response_model=Health, response_model_exclude_none=True)
def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    response_model_exclude_none=True,
    responses={503: {"model": Readiness, "description": "Not ready, with the reason"}},
)
async def readyz(request: Request) -> JSONResponse:
    startup: Startup = request.app.state.startup
    state: AppState | None = getattr(request.app.state, "dss", None)
    dev_mode = bool(request.app.state.settings.auth.dev_mode)
    store_ok = state is not None and state.started
    engine_ok = state is not None and state.engine is not None and await state.engine.ready()
    needs_engine = bool(request.app.state.settings.engine.enabled)
    ok = store_ok and (engine_ok or not needs_engine)
    reason = None
    if not ok:
        reason = startup.reason
        if startup.phase is Phase.READY:  # it was ready: the engine died since
            reason = "engine not healthy"
    # The tiers are known once the store is open, engine or not (also while the engine starts).
    # Off the event loop: asking Redis again may wait for its (short) timeout.
    store_open = state is not None and startup.phase in (Phase.ENGINE_STARTING, Phase.READY)
    tiers = await asyncio.to_thread(_tier_health, state) if store_open and state is not None else None
    engine = state.engine if state is not None else None
    body = Readiness(
        status="ready" if ok else "not ready",
        reason=reason,
        kv_caching=engine.kv_caching if engine is not None else None,
        uncached_reason=engine.uncached_reason if engine is not None else None,
        store=state is not None,
        engine=engine_ok,
        dev_mode=dev_mode,
        tiers=tiers,
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)
