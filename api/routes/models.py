"""`GET /v1/models`: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CallerDep, StateDep
from api.http_errors import error_responses
from api.shapes.resources import ModelOut
from api.shapes.schemas import ListResponse

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ListResponse[ModelOut], responses=error_responses(401))
def list_models(state: StateDep, _caller: CallerDep) -> ListResponse[ModelOut]:
    engine = state.engine
    if engine is None:
        return ListResponse[ModelOut](data=[])
    model = ModelOut(id=engine.model_name, created=engine.created, max_model_len=engine.max_model_len)
    return ListResponse[ModelOut](data=[model], first_id=model.id, last_id=model.id)
