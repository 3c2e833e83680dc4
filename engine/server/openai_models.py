"""`/v1/models`: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.protocol import ModelCard, ModelList, now_seconds
from npuserve.engine.server.state import get_state

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/v1/models", response_model=ModelList)
@router.head("/v1/models", response_model=ModelList, include_in_schema=False)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    engine = state.engine.engine
    card = ModelCard(id=state.served_model_name, created=now_seconds(), root=str(engine.model_dir),
                     max_model_len=state.max_model_len())
    return ModelList(data=[card])
