"""The OpenAI-compatible HTTP API over an AsyncEngine.

Handlers turn a request into token ids (kvscale.server.tokenization, shared with the router) and
SamplingParams, hand them to the engine thread, and read each request's stream: either to the
end (JSON response) or chunk by chunk (server-sent events ending in ``data: [DONE]``). Every
error, from malformed JSON to a dead engine, leaves as the OpenAI error body. A watcher on the
ASGI receive channel aborts a request the moment its client disconnects, so its KV blocks go
back to the pool even while it is still waiting in the queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvscale.server import protocol as p
from kvscale.server.admission import (  # noqa: F401 - resolve_max_tokens is re-exported
    InvalidRequest,
    check_prompt,
    resolve_max_tokens,
)
from kvscale.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvscale.server.drain import Drain, DrainMiddleware
from kvscale.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvscale.server.metrics import HTTPStatusMiddleware, ServerMetrics
from kvscale.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.tokenization import chat_prompt_token_ids, completion_prompt_token_ids

logger = logging.getLogger(__name__)

# Probes and scrapers never carry the API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc",
                        "/docs/oauth2-redirect"})
RETRY_AFTER_S = 1

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (503, "queue full or engine stopped"),
    )
}


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.error_body(self.message, self.err_type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


# ----------------------------------------------------------------------------- pure mapping


def sampling_params_from(
    request: p.SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams for a completion or chat request (OpenAI's defaults where unset)."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    stop = request.stop
    return SamplingParams(
        n=request.n,
        temperature=pick(request.temperature, 1.0),
        top_p=pick(request.top_p, 1.0),
        top_k=pick(request.top_k, -1),
        min_p=pick(request.min_p, 0.0),
        seed=request.seed,
        repetition_penalty=pick(request.repetition_penalty, 1.0),
        presence_penalty=pick(request.presence_penalty, 0.0),
        frequency_penalty=pick(request.frequency_penalty, 0.0),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
    )


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts (one engine request each)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    if prompt and isinstance(prompt[0], list):
        return [list(ids) for ids in prompt]
    return [list(prompt)]


def _top_entries(position: PositionLogprobs, num_top: int) -> list[tuple[int, Any]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(token_id, lp) for token_id, lp in ranked if lp.rank <= num_top][:num_top]


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], num_top: int,
    text_offset: int, decode: Callable[[int], str],
) -> p.CompletionLogprobs:
    """The legacy completions logprobs object for tokens (a prompt's first token has no position)."""
    result = p.CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position is not None else None
        token = chosen.decoded_token if chosen is not None else decode(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob if chosen is not None else None)
        top = None
        if position is not None and num_top > 0:
            top = {lp.decoded_token: lp.logprob for _, lp in _top_entries(position, num_top)}
            if chosen is not None:
                top.setdefault(token, chosen.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
    decode: Callable[[int], str],
) -> p.ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        token = chosen.decoded_token if chosen is not None else decode(token_id)
        content.append(p.ChatTokenLogprob(
            token=token,
            logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=list(token.encode("utf-8")),
            top_logprobs=[
                p.ChatTopLogprob(token=lp.decoded_token, logprob=lp.logprob,
                                 bytes=list(lp.decoded_token.encode("utf-8")))
                for _, lp in _top_entries(position, num_top)
            ],
        ))
    return p.ChatLogprobs(content=content)


def _finish_reason(output: CompletionOutput) -> str | None:
    return output.finish_reason


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ----------------------------------------------------------------------------- the app


@dataclass
class _Prepared:
    """A validated request, ready for the engine: one prompt per engine request."""

    request_id: str
    prompts: list[list[int]]
    echo_texts: list[str]
    params: list[SamplingParams]
    cache_salt: str | None


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        tokenizer: Any,
        served_model_names: Sequence[str],
        max_model_len: int,
        api_key: str | None = None,
        max_queue_len: int | None = None,
        model_root: str | None = None,
        version: str = "0",
        vocab_size: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.max_model_len = max_model_len
        self.api_key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_queue_len = max_queue_len
        self.model_root = model_root
        self.version = version
        # Ids the model embeds and the tokenizer decodes (the engine asserts the model's bound).
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)

    # -- checks shared by every generate endpoint

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                           param="model", code="model_not_found")

    def check_capacity(self) -> None:
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", "server_error", code="engine_dead")
        if self.max_queue_len is not None and self.engine.num_waiting >= self.max_queue_len:
            raise APIError(
                503, f"The server is busy: {self.engine.num_waiting} requests are waiting "
                f"(--max-queue-len {self.max_queue_len}). Retry later.", "server_error",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        try:
            check_prompt(ids, self.vocab_size, param)
        except InvalidRequest as exc:
            raise bad_request(exc.message, exc.param) from exc

    def is_authorized(self, path: str, method: str, authorization: str) -> bool:
        if self.api_key_digest is None or path in OPEN_PATHS or method == "OPTIONS":
            return True
        scheme, _, token = authorization.partition(" ")
        # Compare digests: equal length, constant time, no length leak.
        given = hashlib.sha256(token.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.api_key_digest)

    # -- preparing requests

    def prepare_completion(self, body: p.CompletionRequest) -> _Prepared:
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options can only be set when stream is true.", "stream_options")
        prompts, echo_texts, params = [], [], []
        # echo with logprobs returns the prompt tokens' logprobs too (what scoring harnesses use).
        prompt_logprobs = body.logprobs if body.echo else None
        for prompt in completion_prompts(body.prompt):
            ids = completion_prompt_token_ids(self.tokenizer, prompt)
            self.check_prompt(ids)
            try:
                max_tokens = resolve_max_tokens(body.max_tokens, len(ids), self.max_model_len)
                params.append(sampling_params_from(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                                   prompt_logprobs=prompt_logprobs))
            except ValueError as exc:
                raise bad_request(str(exc), getattr(exc, "param", None)) from exc
            prompts.append(ids)
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
            else:
                echo_texts.append("")
        return _Prepared(p.random_id("cmpl"), prompts, echo_texts, params, body.cache_salt)

    def prepare_chat(self, body: p.ChatCompletionRequest) -> _Prepared:
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options can only be set when stream is true.", "stream_options")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        ids = self.chat_ids(body.messages)
        self.check_prompt(ids, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            max_tokens = resolve_max_tokens(requested, len(ids), self.max_model_len)
            params = sampling_params_from(body, max_tokens=max_tokens, logprobs=logprobs)
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None)) from exc
        return _Prepared(p.random_id("chatcmpl"), [ids], [""], [params], body.cache_salt)

    def chat_ids(self, messages: list[p.ChatMessage]) -> list[int]:
        # Back to the JSON the client sent: the router tokenizes that very form of the messages.
        conversation = [m.model_dump(exclude_none=True) for m in messages]
        try:
            return chat_prompt_token_ids(self.tokenizer, conversation)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # jinja raises its own errors for conversations it rejects
            raise bad_request(f"The chat template rejected these messages: {exc}", "messages") from exc

    # -- running requests

    async def open_streams(self, prepared: _Prepared) -> list[RequestStream]:
        self.check_capacity()
        streams: list[RequestStream] = []
        try:
            for index, (ids, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True)):
                request_id = prepared.request_id if len(prepared.prompts) == 1 else f"{prepared.request_id}-{index}"
                streams.append(await self.engine.add_request(
                    request_id, ids, params, num_prompt_tokens=len(ids), cache_salt=prepared.cache_salt,
                ))
        except EngineDeadError as exc:
            self.release(streams)
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            self.release(streams)
            raise bad_request(str(exc)) from exc
        except BaseException:
            self.release(streams)
            raise
        return streams

    def release(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.release(stream)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(prompt index, newest output) from several streams as they come; None: that one aborted."""
    if len(streams) == 1:
        while True:
            output = await streams[0].next()
            yield 0, output
            if output is None or output.finished:
                return
    pending = {asyncio.ensure_future(stream.next()): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()
                yield index, output
                if output is not None and not output.finished:
                    pending[asyncio.ensure_future(streams[index].next())] = index
    finally:
        for task in pending:
            task.cancel()


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def build_app(
    engine: AsyncEngine,
    *,
    tokenizer: Any,
    served_model_names: Sequence[str],
    max_model_len: int,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    model_root: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
    drain: Drain | None = None,
    vocab_size: int | None = None,
) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown.

    ``drain`` (kvscale.server.drain) is what a SIGTERM flips: /health and new generate requests
    then answer 503 while the open ones finish.
    """
    from kvscale import __version__

    server = OpenAIServer(engine, tokenizer=tokenizer, served_model_names=served_model_names,
                          max_model_len=max_model_len, api_key=api_key,
                          max_queue_len=max_queue_len, model_root=model_root, version=__version__,
                          vocab_size=vocab_size)
    metrics = ServerMetrics(server.model_name, lambda: engine.stats)
    engine.observe(metrics.on_step, metrics.on_request_end)

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

    if api_key:
        app.add_middleware(_APIKeyMiddleware, server=server)
    # Added last, so it runs first: a draining server turns new work away before anything else.
    app.add_middleware(DrainMiddleware, drain=drain, guarded=_is_generate)
    app.add_middleware(HTTPStatusMiddleware, metrics=metrics)  # outermost: counts 401s too

    # ------------------------------------------------------------------ plain endpoints

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return JSONResponse(p.error_body("The server is draining for shutdown.", "server_error",
                                             code="draining"), status_code=503)
        if engine.is_alive:
            return Response(status_code=200)
        return JSONResponse(p.error_body("The engine loop has stopped.", "server_error",
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
        ])

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of prompt and messages.", "prompt")
        if body.prompt is not None:
            ids = completion_prompt_token_ids(tokenizer, body.prompt)
        else:
            ids = server.chat_ids(body.messages or [])
        return p.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        server.check_model(body.model)
        bad = next((t for t in body.tokens if t >= server.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary (size {server.vocab_size}).", "tokens")
        return p.DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: p.CompletionRequest, request: Request):
        prepared = server.prepare_completion(body)
        streams = await server.open_streams(prepared)
        if body.stream:
            return StreamingResponse(
                _stream_completion(server, body, prepared, streams, request),
                media_type="text/event-stream",
            )
        return await _until_disconnect(request, server, streams, _complete_completion(server, body, prepared, streams))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        prepared = server.prepare_chat(body)
        streams = await server.open_streams(prepared)
        if body.stream:
            return StreamingResponse(
                _stream_chat(server, body, prepared, streams, request),
                media_type="text/event-stream",
            )
        return await _until_disconnect(request, server, streams, _complete_chat(server, body, prepared, streams))

    return app


GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _is_generate(method: str, path: str) -> bool:
    return method == "POST" and path in GENERATE_PATHS


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streamed responses pass through untouched."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not self.server.is_authorized(scope["path"], scope["method"], authorization):
                response = APIError(401, "Incorrect API key provided.", "invalid_request_error",
                                    code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _until_disconnect(request: Request, server: OpenAIServer, streams: list[RequestStream], work) -> Any:
    """Run a non-streaming handler's work; a client that leaves aborts its requests at once."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, lambda: server.release(streams)))
    try:
        return await work
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    finally:
        watcher.cancel()
        server.release(streams)


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    final: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in _merged(streams):
        if output is None:  # aborted: the client is gone, nobody reads the answer
            raise APIError(499, "Client disconnected.", "invalid_request_error")
        final[index] = output
    return [output for output in final if output is not None]


def _choice_index(prompt_index: int, n: int, output_index: int) -> int:
    return prompt_index * n + output_index


def _echoed_logprobs(server: OpenAIServer, body: p.CompletionRequest, prompt_ids: list[int],
                     output: RequestOutput, generated: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """The prompt's tokens and logprobs (offsets from 0), followed by the generated ones."""
    echoed = completion_logprobs(prompt_ids, output.prompt_logprobs, body.logprobs, 0, server.decode_one)
    return p.CompletionLogprobs(
        tokens=echoed.tokens + generated.tokens,
        token_logprobs=echoed.token_logprobs + generated.token_logprobs,
        top_logprobs=echoed.top_logprobs + generated.top_logprobs,
        text_offset=echoed.text_offset + generated.text_offset,
    )


async def _complete_completion(server: OpenAIServer, body: p.CompletionRequest, prepared: _Prepared,
                               streams: list[RequestStream]) -> p.CompletionResponse:
    outputs = await _collect(streams)
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for prompt_index, output in enumerate(outputs):
        prompt_tokens += len(prepared.prompts[prompt_index])
        cached += output.num_cached_tokens
        echo = prepared.echo_texts[prompt_index]
        for completion in sorted(output.outputs, key=lambda c: c.index):
            completion_tokens += len(completion.token_ids)
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs = completion_logprobs(completion.token_ids, completion.logprobs, body.logprobs,
                                               len(echo), server.decode_one)
                if echo:
                    logprobs = _echoed_logprobs(server, body, prepared.prompts[prompt_index], output, logprobs)
            choices.append(p.CompletionChoice(
                index=_choice_index(prompt_index, body.n, completion.index), text=echo + completion.text,
                logprobs=logprobs, finish_reason=_finish_reason(completion),
                stop_reason=completion.stop_reason,
            ))
    return p.CompletionResponse(id=prepared.request_id, model=server.model_name if body.model is None else body.model,
                                choices=choices,
                                usage=p.Usage(**_usage(prompt_tokens, completion_tokens, cached)))


async def _complete_chat(server: OpenAIServer, body: p.ChatCompletionRequest, prepared: _Prepared,
                         streams: list[RequestStream]) -> p.ChatCompletionResponse:
    (output,) = await _collect(streams)
    choices = []
    completion_tokens = 0
    for completion in sorted(output.outputs, key=lambda c: c.index):
        completion_tokens += len(completion.token_ids)
        logprobs = None
        if body.logprobs and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0,
                                     server.decode_one)
        choices.append(p.ChatChoice(
            index=completion.index, message=p.ChatResponseMessage(content=completion.text),
            logprobs=logprobs, finish_reason=_finish_reason(completion), stop_reason=completion.stop_reason,
        ))
    usage = _usage(len(prepared.prompts[0]), completion_tokens, output.num_cached_tokens)
    return p.ChatCompletionResponse(id=prepared.request_id, model=body.model or server.model_name,
                                    choices=choices, usage=p.Usage(**usage))


def _stream_error(exc: BaseException) -> str:
    return _sse(p.error_body(str(exc), "server_error", code="engine_dead"))


async def _stream_completion(server: OpenAIServer, body: p.CompletionRequest, prepared: _Prepared,
                             streams: list[RequestStream], request: Request) -> AsyncIterator[str]:
    watcher = asyncio.ensure_future(_watch_disconnect(request, lambda: server.release(streams)))
    created = int(time.time())
    model = body.model or server.model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # Per (prompt, choice): characters and tokens already sent.
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        payload: dict[str, Any] = {"id": prepared.request_id, "object": "text_completion",
                                   "created": created, "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return _sse(payload)

    try:
        async for prompt_index, output in _merged(streams):
            if output is None:
                return  # aborted: the client is gone
            if output.finished:
                finals[prompt_index] = output
            choices = []
            for completion in output.outputs:
                key = (prompt_index, completion.index)
                first = key not in sent_text
                text_from = sent_text.get(key, 0)
                tokens_from = sent_tokens.get(key, 0)
                delta = completion.text[text_from:]
                echo = prepared.echo_texts[prompt_index]
                if not delta and not completion.finished and not (first and echo):
                    continue
                if first:
                    delta = echo + delta
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    generated = completion_logprobs(
                        completion.token_ids[tokens_from:], completion.logprobs[tokens_from:],
                        body.logprobs, len(echo) + text_from, server.decode_one,
                    )
                    if first and echo:
                        generated = _echoed_logprobs(server, body, prepared.prompts[prompt_index], output, generated)
                    logprobs = generated.model_dump()
                sent_text[key] = len(completion.text)
                sent_tokens[key] = len(completion.token_ids)
                choices.append({"index": _choice_index(prompt_index, body.n, completion.index),
                                "text": delta, "logprobs": logprobs,
                                "finish_reason": completion.finish_reason,
                                "stop_reason": completion.stop_reason})
            if choices:
                yield chunk(choices)
        if include_usage:
            prompt_tokens = sum(len(ids) for ids in prepared.prompts)
            completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
            cached = sum(o.num_cached_tokens for o in finals.values())
            yield chunk([], _usage(prompt_tokens, completion_tokens, cached))
        yield _sse("[DONE]")
    except EngineDeadError as exc:
        yield _stream_error(exc)
        yield _sse("[DONE]")
    finally:
        watcher.cancel()
        server.release(streams)


async def _stream_chat(server: OpenAIServer, body: p.ChatCompletionRequest, prepared: _Prepared,
                       streams: list[RequestStream], request: Request) -> AsyncIterator[str]:
    watcher = asyncio.ensure_future(_watch_disconnect(request, lambda: server.release(streams)))
    created = int(time.time())
    model = body.model or server.model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    final: RequestOutput | None = None

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        payload: dict[str, Any] = {"id": prepared.request_id, "object": "chat.completion.chunk",
                                   "created": created, "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return _sse(payload)

    try:
        # The role comes first, in a chunk of its own, as OpenAI sends it.
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
        async for _, output in _merged(streams):
            if output is None:
                return
            if output.finished:
                final = output
            choices = []
            for completion in output.outputs:
                text_from = sent_text.get(completion.index, 0)
                tokens_from = sent_tokens.get(completion.index, 0)
                delta = completion.text[text_from:]
                if not delta and not completion.finished:
                    continue
                logprobs = None
                if body.logprobs and completion.logprobs is not None:
                    logprobs = chat_logprobs(
                        completion.token_ids[tokens_from:], completion.logprobs[tokens_from:],
                        body.top_logprobs or 0, server.decode_one,
                    ).model_dump()
                sent_text[completion.index] = len(completion.text)
                sent_tokens[completion.index] = len(completion.token_ids)
                choices.append({"index": completion.index,
                                "delta": {"content": delta} if delta else {},
                                "logprobs": logprobs, "finish_reason": completion.finish_reason,
                                "stop_reason": completion.stop_reason})
            if choices:
                yield chunk(choices)
        if include_usage and final is not None:
            completion_tokens = sum(len(c.token_ids) for c in final.outputs)
            yield chunk([], _usage(len(prepared.prompts[0]), completion_tokens, final.num_cached_tokens))
        yield _sse("[DONE]")
    except EngineDeadError as exc:
        yield _stream_error(exc)
        yield _sse("[DONE]")
    finally:
        watcher.cancel()
        server.release(streams)
