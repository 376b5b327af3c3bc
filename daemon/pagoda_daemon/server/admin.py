"""The admin routes: elastic expert parallelism's resize and its state. vLLM's names
(``POST /scale_elastic_ep``, ``GET /is_scaling_elastic_ep``) and ``GET /elastic_ep`` with the
whole state (size, bounds, the latest transition's phase, time and error); and LoRA adapters
registered and unregistered while serving, under vLLM's names and bodies
(``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``), which read a directory on the
server's own filesystem.

They take the admin key (``--admin-api-key`` / ``PAGODA_ADMIN_API_KEY``), never the users' API
key: a client allowed to generate is not allowed to resize the replica. With no admin key
configured they answer 403 (docs/security.md)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pagoda_daemon.lora.names import MAX_NAME_CHARS, AdapterError
from pagoda_daemon.lora.registry import AdapterRegistry
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


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: StrictStr = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_int_id: StrictInt | None = None  # vLLM's clients may send it; names identify adapters here


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


def _registry(adapters: AdapterRegistry | None) -> AdapterRegistry:
    if adapters is None:
        raise APIError("LoRA adapters are off on this server (start it with --enable-lora)", 400, code="lora_off")
    return adapters


def add_routes(app: FastAPI, client: EngineClient, keys: APIKeys, parse,
               adapters: AdapterRegistry | None = None) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        """Read, check and register an adapter: requests may name it from the answer on."""
        _check_admin(raw, keys)
        body = await parse(LoadAdapterRequest, raw)
        registry = _registry(adapters)
        try:
            lora = await asyncio.to_thread(registry.add, body.lora_name, body.lora_path)
        except AdapterError as e:
            raise APIError(str(e), 400, param="lora_path", code="invalid_adapter") from e
        return {"message": f"LoRA adapter '{lora.name}' added", "name": lora.name, "digest": lora.digest}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        """Unregister an adapter: new requests naming it get a 400; those admitted finish with it."""
        _check_admin(raw, keys)
        body = await parse(UnloadAdapterRequest, raw)
        try:
            _registry(adapters).remove(body.lora_name)
        except KeyError:
            raise APIError(f"no LoRA adapter named '{body.lora_name}' is registered", 404, param="lora_name",
                           code="not_found") from None
        return {"message": f"LoRA adapter '{body.lora_name}' removed"}


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
