"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: vLLM's LoRA adapters loaded
and unloaded while the server runs, served only with ``--allow-runtime-lora-updating`` (loading a
path the server can read is a privilege; docs/server.md, "Loading adapters at run time").

The engine core reads and checks the adapter (server/engine/lora_updates.py); the front end's
registry (``OpenAIServer.lora_modules``: what /v1/models lists and a request's ``model`` may
name) changes only once the core agreed. An unload takes the name out of the registry first, so
no new request reaches the core with it, and puts it back when the core refuses (409: requests on
it have not finished). One update at a time.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from kvscale.server.entrypoints.lora_modules import LoRAModulePath
from kvscale.server.entrypoints.serving import ERROR_RESPONSES, APIError, OpenAIServer, bad_request

MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)


def refusal_error(kind: str, why: str) -> APIError:
    """The engine's refusal of an update (server/engine/lora_updates.py's kinds) as its HTTP error."""
    if kind == "invalid":
        return bad_request(why, "lora_path")
    if kind == "not_found":
        return APIError(404, why, "invalid_request_error", param="lora_name", code="model_not_found")
    if kind == "busy":
        return APIError(409, why, "invalid_request_error", param="lora_name", code="lora_adapter_in_use")
    return APIError(500, why, "server_error")


async def load_lora_adapter(server: OpenAIServer, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
    name = body.lora_name
    if name in server.served_model_names:
        raise bad_request(f"`{name}` is a served model name (--served-model-name), not an adapter's.", "lora_name")
    if name in server.lora_modules:
        raise bad_request(f"The LoRA adapter `{name}` is already loaded; unload it first.", "lora_name")
    refused = await server.engine.update_lora(name, os.path.abspath(body.lora_path))
    if refused is not None:
        raise refusal_error(*refused)
    server.lora_modules[name] = LoRAModulePath(name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(server: OpenAIServer, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
    name = body.lora_name
    module = server.lora_modules.pop(name, None)
    if module is None:
        raise APIError(404, f"The LoRA adapter `{name}` cannot be found.", "invalid_request_error",
                       param="lora_name", code="model_not_found")
    refused = await server.engine.update_lora(name, None)
    if refused is not None:
        server.lora_modules[name] = module
        raise refusal_error(*refused)
    if server.metrics is not None:
        server.metrics.forget_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_update_routes(app: FastAPI, server: OpenAIServer) -> None:
    """The two routes, one update at a time (a load and an unload of one name never interleave)."""
    lock = asyncio.Lock()

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def load(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        async with lock:
            return await load_lora_adapter(server, body)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def unload(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        async with lock:
            return await unload_lora_adapter(server, body)
