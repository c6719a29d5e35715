"""Liveness (`/healthz`: the process answers) and readiness (`/readyz`: store open, engine ready)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import StateDep
from api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_model_exclude_none=True)
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health, "description": "Not ready"}})
async def readyz(state: StateDep) -> JSONResponse:
    store_ok = state.started
    engine_ok = state.engine is not None and await state.engine.ready()
    needs_engine = state.settings.engine.enabled
    ok = store_ok and (engine_ok or not needs_engine)
    body = Health(
        status="ready" if ok else "not ready", store=store_ok, engine=engine_ok, dev_mode=state.dev_mode
    )
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
