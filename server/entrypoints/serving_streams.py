"""Reading engine streams into responses: the whole answer for a JSON response, or the one loop
that turns engine deltas into server-sent events.

Each generate endpoint (serving_completions.py, serving_chat.py) brings a small formatter: how a
choice of one delta looks on the wire, and how a chunk is wrapped. The loop here does the rest:
disconnect watching, merging several prompts' streams, usage, the closing ``data: [DONE]``, and
engine failure. A client that leaves aborts its requests at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvscale.server.engine.engine_front import EngineDeadError, RequestStream
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.response_parts import usage
from kvscale.server.entrypoints.serving import APIError, OpenAIServer, Prepared
from kvscale.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput, merge_deltas


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def refusal(server: OpenAIServer, output: RequestOutput | None, prepared: Prepared) -> APIError | None:
    """The error for an output the engine ended before any token: a 400 for a grammar that failed
    to compile or ran past its CPU-time limit, a 503 for one that waited past the wall-clock bound
    (busy CPUs, not the schema: a retry is served from the compile cache)."""
    if output is None or output.error is None:
        return None
    reason = output.error_reason or "unsupported"
    server.count_refusal(reason)
    if reason == "wait_timeout":
        return APIError(503, output.error, "server_error", param=prepared.constraint_param,
                        code="grammar_compile_wait_timeout", headers={"Retry-After": "1"})
    return APIError(400, output.error, "invalid_request_error", param=prepared.constraint_param)


async def first_outputs(server: OpenAIServer, streams: list[RequestStream],
                        prepared: Prepared) -> list[RequestOutput | None]:
    """Each stream's first output, read before a streamed response starts, so that a request the
    engine refuses (its grammar) gets a plain 400 rather than an error inside a 200 stream."""
    try:
        outputs = list(await asyncio.gather(*(stream.next() for stream in streams)))
    except EngineDeadError as exc:
        server.release(streams)
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    except BaseException:
        server.release(streams)
        raise
    for output in outputs:
        error = refusal(server, output, prepared)
        if error is not None:
            server.release(streams)
            raise error
    return outputs


async def merged(streams: list[RequestStream], first: list[RequestOutput | None] | None = None
                 ) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(prompt index, delta) from several streams as they come; None: that one aborted. ``first``:
    outputs already read from each stream (first_outputs), yielded before the rest."""
    live = list(range(len(streams)))
    if first is not None:
        live = []
        for index, output in enumerate(first):
            yield index, output
            if output is not None and not output.finished:
                live.append(index)
    if len(streams) == 1:
        while live:
            output = await streams[0].next()
            yield 0, output
            if output is None or output.finished:
                return
        return
    pending = {asyncio.ensure_future(streams[index].next()): index for index in live}
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


async def collect(server: OpenAIServer, streams: list[RequestStream], prepared: Prepared) -> list[RequestOutput]:
    """Each stream's whole answer (its deltas merged), in prompt order; a 400 for a request the
    engine refused."""
    deltas: list[list[RequestOutput]] = [[] for _ in streams]
    async for index, output in merged(streams):
        if output is None:  # aborted: the client is gone, nobody reads the answer
            raise APIError(499, "Client disconnected.", "invalid_request_error")
        error = refusal(server, output, prepared)
        if error is not None:
            raise error
        deltas[index].append(output)
    return [merge_deltas(outputs) for outputs in deltas if outputs]


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def while_connected(request: Request, server: OpenAIServer, streams: list[RequestStream],
                          work: Awaitable[Any]) -> Any:
    """``work``'s result; a client that leaves meanwhile aborts its requests at once (their
    streams then end, so ``work`` does too), which frees their KV blocks."""
    watcher = asyncio.ensure_future(watch_disconnect(request, lambda: server.release(streams)))
    try:
        return await work
    finally:
        watcher.cancel()


async def until_disconnect(request: Request, server: OpenAIServer, streams: list[RequestStream],
                           work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler's work; a client that leaves aborts its requests at once, and
    so does ``--request-timeout`` (a 504): a client of a non-streamed answer sees nothing until
    it is whole, so the server bounds the wait rather than leave it to each client's patience
    (docs/server.md "Request limits")."""
    timeout = server.request_timeout_s
    try:
        return await asyncio.wait_for(while_connected(request, server, streams, work), timeout)
    except TimeoutError as exc:
        if timeout is None:  # not the deadline's: the work's own
            raise
        raise APIError(
            504, f"The answer was not ready within {timeout:g} s (--request-timeout); its "
            f"{len(streams)} sequence(s) were stopped. Stream it, or send fewer prompts, a smaller "
            "n or max_tokens.", "server_error", code="request_timeout") from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    finally:
        server.release(streams)


async def first_outputs_while_connected(request: Request, server: OpenAIServer, streams: list[RequestStream],
                                        prepared: Prepared) -> list[RequestOutput | None]:
    """``first_outputs`` for a streamed request, which may wait for its grammar to compile
    before the response starts: a client that leaves meanwhile aborts it at once."""
    return await while_connected(request, server, streams, first_outputs(server, streams, prepared))


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

    def held(self) -> None:
        """The pending text went to a parser that sends nothing yet (a tool call's start): its
        tokens and their logprobs wait for the next chunk that goes out."""
        self.text = []


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

    def closing(self) -> list[list[dict]]:
        """Chunks sent after the last output (chat's tool calls held for the whole answer)."""
        return []

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
                        formatter: StreamFormatter, first: list[RequestOutput | None] | None = None
                        ) -> AsyncIterator[str]:
    """Server-sent events for a streamed request, ending with ``data: [DONE]``."""
    watcher = asyncio.ensure_future(watch_disconnect(request, lambda: server.release(streams)))
    try:
        opening = formatter.opening()
        if opening:
            yield sse(formatter.chunk(opening))
        async for prompt_index, output in merged(streams, first):
            if output is None:
                return  # aborted: the client is gone
            choices = formatter.choices(prompt_index, output)
            if choices:
                yield sse(formatter.chunk(choices))
        for choices in formatter.closing():
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
