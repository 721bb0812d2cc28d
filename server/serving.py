"""What every OpenAI endpoint shares: the server's state and checks, errors, opening engine
streams, and the one loop that turns engine deltas into server-sent events.

Each generate endpoint (serving_completions.py, serving_chat.py) prepares its request and brings
a small formatter: how a choice of one delta looks on the wire, and how a chunk is wrapped. The
loop below does the rest: disconnect watching, merging several prompts' streams, usage, the
closing ``data: [DONE]``, and engine failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvscale.server import protocol as p
from kvscale.server.admission import InvalidRequest, check_prompt
from kvscale.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvscale.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput, merge_deltas
from kvscale.server.sampling_params import SamplingParams

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
        (503, "queue full, engine stopped, or draining for shutdown"),
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


def top_entries(position: PositionLogprobs, num_top: int) -> list[tuple[int, Any]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(token_id, lp) for token_id, lp in ranked if lp.rank <= num_top][:num_top]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def check_stream_options(body: p.SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")


@dataclass
class Prepared:
    """A validated request, ready for the engine: one prompt per engine request."""

    request_id: str
    prompts: list[list[int]]
    echo_texts: list[str]
    params: list[SamplingParams]
    cache_salt: str | None


class OpenAIServer:
    """The state every endpoint reads, and the checks and engine calls they share."""

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

    # -- endpoints prepare requests in their own modules; kept here for callers of the old API

    def prepare_completion(self, body: p.CompletionRequest) -> Prepared:
        from kvscale.server.serving_completions import prepare_completion

        return prepare_completion(self, body)

    def prepare_chat(self, body: p.ChatCompletionRequest) -> Prepared:
        from kvscale.server.serving_chat import prepare_chat

        return prepare_chat(self, body)

    def chat_ids(self, messages: list[p.ChatMessage]) -> list[int]:
        from kvscale.server.serving_chat import chat_ids

        return chat_ids(self, messages)

    # -- running requests

    async def open_streams(self, prepared: Prepared) -> list[RequestStream]:
        """Hand every prompt to the engine in one go (they start in the same step)."""
        self.check_capacity()
        many = len(prepared.prompts) > 1
        requests = [
            (f"{prepared.request_id}-{index}" if many else prepared.request_id, ids, params, prepared.cache_salt)
            for index, (ids, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True))
        ]
        try:
            return await self.engine.add_requests(requests)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            raise bad_request(str(exc)) from exc

    def release(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.release(stream)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


# ----------------------------------------------------------------------------- reading streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(prompt index, delta) from several streams as they come; None: that one aborted."""
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


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's whole answer (its deltas merged), in prompt order."""
    deltas: list[list[RequestOutput]] = [[] for _ in streams]
    async for index, output in merged(streams):
        if output is None:  # aborted: the client is gone, nobody reads the answer
            raise APIError(499, "Client disconnected.", "invalid_request_error")
        deltas[index].append(output)
    return [merge_deltas(outputs) for outputs in deltas if outputs]


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def until_disconnect(request: Request, server: OpenAIServer, streams: list[RequestStream], work) -> Any:
    """Run a non-streaming handler's work; a client that leaves aborts its requests at once."""
    watcher = asyncio.ensure_future(watch_disconnect(request, lambda: server.release(streams)))
    try:
        return await work
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    finally:
        watcher.cancel()
        server.release(streams)


# ----------------------------------------------------------------------------- the streaming loop


@dataclass
class ChoiceState:
    """One choice of a stream: what is waiting to be sent and what has been."""

    started: bool = False  # a chunk for it went out
    text_sent: int = 0  # characters of generated text sent
    num_tokens: int = 0  # tokens generated (for usage)
    text: list[str] = field(default_factory=list)  # not sent yet
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    def take(self, completion: CompletionOutput) -> None:
        self.num_tokens += len(completion.token_ids)
        self.text.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs.extend(completion.logprobs)

    def sent(self, text: str) -> None:
        self.started = True
        self.text_sent += len(text)
        self.text, self.token_ids, self.logprobs = [], [], []


class StreamFormatter:
    """How one endpoint's stream looks; the loop in ``stream_events`` drives it."""

    object_name = ""

    def __init__(self, server: OpenAIServer, body: p.SamplingFields, prepared: Prepared) -> None:
        self.server = server
        self.body = body
        self.prepared = prepared
        self.created = int(time.time())
        self.model = body.model or server.model_name
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.states: dict[tuple[int, int], ChoiceState] = {}
        self.cached_tokens = [0] * len(prepared.prompts)
        self.prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prepared.prompts)

    def opening(self) -> list[dict]:
        """Choices sent before any output (chat's role chunk)."""
        return []

    def choice(self, prompt_index: int, completion: CompletionOutput, state: ChoiceState) -> dict | None:
        """The wire form of a choice's pending delta, or None when there is nothing to send yet."""
        raise NotImplementedError

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        payload: dict[str, Any] = {"id": self.prepared.request_id, "object": self.object_name,
                                   "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage_
        return payload

    def choices(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        result = []
        for completion in output.outputs:
            state = self.states.setdefault((prompt_index, completion.index), ChoiceState())
            state.take(completion)
            choice = self.choice(prompt_index, completion, state)
            if choice is not None:
                result.append(choice)
        return result

    def usage(self) -> dict:
        return usage(sum(len(ids) for ids in self.prepared.prompts),
                     sum(state.num_tokens for state in self.states.values()), sum(self.cached_tokens))


async def stream_events(server: OpenAIServer, streams: list[RequestStream], request: Request,
                        formatter: StreamFormatter) -> AsyncIterator[str]:
    """Server-sent events for a streamed request, ending with ``data: [DONE]``."""
    watcher = asyncio.ensure_future(watch_disconnect(request, lambda: server.release(streams)))
    try:
        opening = formatter.opening()
        if opening:
            yield sse(formatter.chunk(opening))
        async for prompt_index, output in merged(streams):
            if output is None:
                return  # aborted: the client is gone
            choices = formatter.choices(prompt_index, output)
            if choices:
                yield sse(formatter.chunk(choices))
        if formatter.include_usage:
            yield sse(formatter.chunk([], formatter.usage()))
        yield sse("[DONE]")
    except EngineDeadError as exc:
        yield sse(p.error_body(str(exc), "server_error", code="engine_dead"))
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        server.release(streams)
