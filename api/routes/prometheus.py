"""`GET /metrics`: the Prometheus text format (admin keys; open in development mode). Named for
the format, not the path, so that it is not a second `metrics.py` beside `api/metrics.py`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

from api.deps import AdminDep, StateDep
from api.http_errors import error_responses
from api.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={**error_responses(401, 403), 200: {"content": {CONTENT_TYPE: {}}, "description": "Metrics"}},
)
async def metrics(state: StateDep, _admin: AdminDep) -> Response:
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
