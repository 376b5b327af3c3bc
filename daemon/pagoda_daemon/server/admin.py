"""The admin routes: elastic expert parallelism's resize and its state. vLLM's names
(``POST /scale_elastic_ep``, ``GET /is_scaling_elastic_ep``) and ``GET /elastic_ep`` with the
whole state (size, bounds, the latest transition's phase, time and error).

They take the admin key (``--admin-api-key`` / ``PAGODA_ADMIN_API_KEY``), never the users' API
key: a client allowed to generate is not allowed to resize the replica. With no admin key
configured they answer 403 (docs/security.md)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pagoda_daemon.server.auth import ADMIN_API_KEY_ENV, APIKeys
from pagoda_daemon.server.engine_client import EngineClient, ResizeBusy
from pagoda_daemon.server.errors import APIError


class ResizeRequest(BaseModel):
    """The new expert-parallel size; ``new_data_parallel_size`` is vLLM's name for the same
    request (its elastic EP grows data-parallel engines), accepted so its scripts work."""

    model_config = ConfigDict(extra="forbid")
    new_expert_parallel_size: StrictInt | None = Field(None, ge=1, le=64)
    new_data_parallel_size: StrictInt | None = Field(None, ge=1, le=64)

    def size(self) -> int:
        given = [v for v in (self.new_expert_parallel_size, self.new_data_parallel_size) if v is not None]
        if len(given) != 1:
            raise APIError("give the new size as new_expert_parallel_size (or vLLM's new_data_parallel_size), once",
                           400, param="new_expert_parallel_size")
        return given[0]


def _check_admin(raw: Request, keys: APIKeys) -> None:
    if not keys.enabled:
        raise APIError(f"the admin routes are off: start the server with --admin-api-key (or {ADMIN_API_KEY_ENV})",
                       403, code="admin_routes_off")
    refusal = keys.refusal(raw.url.path, raw.headers.raw)
    if refusal is not None:
        raise refusal


def _state(client: EngineClient) -> dict:
    state = client.elastic_state()
    if state is None:
        raise APIError("elastic expert parallelism is off on this replica (start it with --elastic-ep-max-size)",
                       400, code="elastic_ep_off")
    return state


def add_routes(app: FastAPI, client: EngineClient, keys: APIKeys, parse) -> None:
    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(raw: Request):
        _check_admin(raw, keys)
        size = (await parse(ResizeRequest, raw)).size()
        _state(client)
        if not client.is_ready:
            raise APIError("the engine is not ready", 503, code="not_ready")
        try:
            client.resize_experts(size)
        except ResizeBusy as e:
            raise APIError(str(e), 409, code="resize_in_progress") from e
        except ValueError as e:
            raise APIError(str(e), 400, param="new_expert_parallel_size") from e
        return JSONResponse({"message": f"resize to {size} expert-parallel ranks requested",
                             "elastic_ep": client.elastic_state()}, status_code=202)

    @app.get("/is_scaling_elastic_ep")
    async def is_scaling_elastic_ep(raw: Request):
        _check_admin(raw, keys)
        _state(client)
        return {"is_scaling_elastic_ep": client.is_resizing()}

    @app.get("/elastic_ep")
    async def elastic_ep(raw: Request):
        _check_admin(raw, keys)
        return {**_state(client), "is_scaling": client.is_resizing()}
