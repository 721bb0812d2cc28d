"""The OpenAI-compatible HTTP API over the engine: the app, its middleware and routes.

One module per endpoint, as vLLM's entrypoints are laid out: serving_completions.py,
serving_chat.py, serving_tokenize.py; what they share (the server's state and checks, opening
engine streams, the one streaming loop) is serving.py. Handlers turn a request into token ids
(kvscale.tokenization, shared with the router) and SamplingParams, hand them to the engine
core, and read each request's delta stream: to the end (JSON response) or chunk by chunk
(server-sent events ending in ``data: [DONE]``). Every error, from malformed JSON to a dead
engine, leaves as the OpenAI error body. A watcher on the ASGI receive channel aborts a request
the moment its client disconnects, so its KV blocks go back to the pool even while it waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvscale.drain import Drain, DrainMiddleware
from kvscale.request_limits import DEFAULT_MAX_QUEUE_LEN, FieldLimits
from kvscale.server.engine.engine_front import EngineFront
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.admission import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvscale.server.entrypoints.lora_modules import LoRAModulePath, lora_model_card
from kvscale.server.entrypoints.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvscale.server.entrypoints.metrics import HTTPStatusMiddleware, ServerMetrics
from kvscale.server.entrypoints.protocol_responses import ResponsesRequest
from kvscale.server.entrypoints.request_json import StrictJSONRoute
from kvscale.server.entrypoints.responses_store import MemoryResponseStore, ResponseStore
from kvscale.server.entrypoints.serving import ERROR_RESPONSES, APIError, OpenAIServer, bad_request
from kvscale.server.entrypoints.serving_chat import create_chat_completion
from kvscale.server.entrypoints.serving_completions import create_completion
from kvscale.server.entrypoints.serving_lora import add_lora_update_routes
from kvscale.server.entrypoints.serving_responses import (
    create_response,
    delete_response,
    retrieve_response,
)
from kvscale.server.entrypoints.serving_tokenize import detokenize, tokenize
from kvscale.server.entrypoints.tenant_header import TenantMiddleware

logger = logging.getLogger(__name__)

__all__ = ["build_app"]

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


def _is_generate(method: str, path: str) -> bool:
    return method == "POST" and path in GENERATE_PATHS


def build_app(
    engine: EngineFront,
    *,
    tokenizer: Any,
    served_model_names: Sequence[str],
    max_model_len: int,
    api_key: str | None = None,
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    field_limits: FieldLimits | None = None,
    model_root: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
    drain: Drain | None = None,
    vocab_size: int | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    stream_interval: int = 1,
    response_store: ResponseStore | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
    allow_runtime_lora_updating: bool = False,
    scheduling_policy: str = "fcfs",
    request_timeout_s: float | None = None,
) -> FastAPI:
    """The FastAPI app; starts reading the engine on startup and stops the engine on shutdown.

    ``drain`` (kvscale.drain) is what a SIGTERM flips: /health and new generate requests
    then answer 503 while the open ones finish. ``response_store`` keeps /v1/responses'
    stored responses (default: this process's bounded memory, docs/server.md "The Responses API").
    ``allow_runtime_lora_updating`` adds /v1/load_lora_adapter and /v1/unload_lora_adapter.
    """
    from kvscale import __version__

    server = OpenAIServer(engine, tokenizer=tokenizer, served_model_names=served_model_names,
                          max_model_len=max_model_len, api_key=api_key,
                          max_queue_len=max_queue_len, max_prompts_per_request=max_prompts_per_request,
                          field_limits=field_limits, model_root=model_root, version=__version__,
                          vocab_size=vocab_size, tool_call_parser=tool_call_parser,
                          enable_auto_tool_choice=enable_auto_tool_choice,
                          stream_interval=stream_interval, lora_modules=lora_modules,
                          scheduling_policy=scheduling_policy, request_timeout_s=request_timeout_s)
    metrics = ServerMetrics(server.model_name, lambda: engine.stats)
    engine.observe(metrics.on_step, metrics.on_request_end)
    server.metrics = metrics
    store: ResponseStore = response_store if response_store is not None else MemoryResponseStore()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="kvscale OpenAI-compatible API", version=__version__, lifespan=lifespan)
    app.router.route_class = StrictJSONRoute
    app.state.server = server
    app.state.metrics = metrics
    drain = drain if drain is not None else Drain()
    app.state.drain = drain

    # ------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"Malformed JSON body: {first.get('msg', '')}").response()
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return bad_request(message or "Invalid request.", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = p.error_body(str(exc.detail), err_type, code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(p.error_body("Internal server error.", "server_error"), status_code=500)

    # The last added runs first: statuses are counted for everything, then a draining server
    # turns new work away, then the key is checked, then the router's tenant header is read
    # (trusted only behind the key: tenant_header.py).
    if api_key:
        app.add_middleware(TenantMiddleware)
        app.add_middleware(_APIKeyMiddleware, server=server)
        # Run by the body limit (kvscale.request_limits) on the head, before the body is read.
        app.state.before_body = lambda scope: _key_refusal(server, scope)
    app.add_middleware(DrainMiddleware, drain=drain, guarded=_is_generate)
    app.add_middleware(HTTPStatusMiddleware, metrics=metrics)  # outermost: counts 401s too

    # ------------------------------------------------------------------ plain endpoints

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return JSONResponse(p.error_body("The server is draining for shutdown.", "server_error",
                                             code="draining"), status_code=503)
        # Dead, or stuck in a step (EngineFront.health_problem): either fails the probe.
        reason = engine.health_problem()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse(p.error_body(reason[:1].upper() + reason[1:] + ".", "server_error",
                                         code="engine_dead"), status_code=503)

    @app.get("/version", response_model=p.VersionResponse)
    async def version() -> p.VersionResponse:
        return p.VersionResponse(version=__version__)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", response_model=p.ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> p.ModelList:
        return p.ModelList(data=[
            p.ModelCard(id=name, root=model_root or name, max_model_len=max_model_len)
            for name in server.served_model_names
        ] + [lora_model_card(m, server.model_name) for m in server.lora_modules.values()])

    if allow_runtime_lora_updating:  # docs/server.md, "Loading adapters at run time"
        add_lora_update_routes(app, server)

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize_endpoint(body: p.TokenizeRequest) -> p.TokenizeResponse:
        return tokenize(server, body)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize_endpoint(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return detokenize(server, body)

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: p.CompletionRequest, request: Request):
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await create_chat_completion(server, body, request)

    @app.post("/v1/responses", responses=ERROR_RESPONSES)
    async def responses_create(body: ResponsesRequest, request: Request):
        return await create_response(server, store, body, request)

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def responses_retrieve(response_id: str, request: Request):
        return await retrieve_response(store, response_id, request)

    @app.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def responses_delete(response_id: str):
        return await delete_response(store, response_id)

    return app


def _key_refusal(server: OpenAIServer, scope: dict) -> JSONResponse | None:
    """The 401 for a request without the key, None for one that may pass."""
    if scope["type"] != "http":
        return None
    authorization = dict(scope.get("headers") or []).get(b"authorization", b"")
    if server.is_authorized(scope["path"], scope["method"], authorization):
        return None
    # Its body is never read: the connection cannot carry another request.
    return APIError(401, "Incorrect API key provided.", "invalid_request_error",
                    code="invalid_api_key", headers={"Connection": "close"}).response()


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streamed responses pass through untouched. The
    same check as ``state.before_body``, for an app served without the body limit around it."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = _key_refusal(self.server, scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)
