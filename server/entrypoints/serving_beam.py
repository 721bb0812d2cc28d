"""Beam search behind /v1/completions and /v1/chat/completions (vLLM's ``use_beam_search``): the request's checks, the
search driven over the engine, the answer (docs/server.md, "Beam search").

The search lives here, above the engine, as vLLM v1's does: each step every live beam of every
prompt is a greedy 1-token engine request (prompt plus the beam's tokens) asking for its top
``2 * n`` logprobs, all of a step's beams added in one batch so they run in the same engine step;
server/engine/beam_search.py turns the candidates into the next beams. The engine needs nothing
new, and the prefix cache's chained block hashes give each beam's request the prompt's and its
parent beam's full blocks: beams share KV blocks without any fork bookkeeping. The price is one
engine round trip per token, and each beam's partial last block recomputed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvscale.server.engine.beam_search import (
    MAX_BEAM_WIDTH,
    Beam,
    BeamSearchState,
    StopCheck,
    beam_step,
    stop_on,
    top_candidates,
)
from kvscale.server.engine.engine_front import EngineDeadError, RequestStream
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.response_parts import usage
from kvscale.server.entrypoints.serving import APIError, OpenAIServer, Prepared, bad_request
from kvscale.server.entrypoints.serving_streams import sse, watch_disconnect
from kvscale.server.entrypoints.tenant_header import REQUEST_TENANT
from kvscale.server.outputs import PositionLogprobs, RequestOutput, merge_deltas
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.model_loader import eos_token_ids

# Fields beam search cannot honour at other than these values (None: unset always passes). Its
# scores are the model's own logprobs, so whatever reshapes or samples the distribution is refused.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "temperature": (0, 0.0), "top_p": (1, 1.0), "top_k": (-1, 0), "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_tokens": (0,), "echo": (False,),
}
_WHY = {
    "temperature": "beam search ranks the model's own logprobs and samples nothing; set 0 or leave it unset",
    "echo": "not implemented with beam search",
    "min_tokens": "not implemented with beam search",
}


def check_beam_search(body: p.SamplingFields) -> bool:
    """Whether ``body`` asks for beam search; a 400 for what it cannot honour with it."""
    use, penalty = body.use_beam_search, body.length_penalty
    if use is not None and not isinstance(use, bool):
        raise bad_request("use_beam_search must be a boolean.", "use_beam_search")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, int | float)
                                or not math.isfinite(penalty)):
        raise bad_request("length_penalty must be a finite number.", "length_penalty")
    if not use:
        if penalty is not None and penalty != 1.0:
            raise bad_request("length_penalty scores beams: it needs use_beam_search: true.", "length_penalty")
        return False
    if body.n > MAX_BEAM_WIDTH:
        raise bad_request(f"With beam search n is the beam width, at most {MAX_BEAM_WIDTH} (each step asks "
                          f"for 2 * n logprobs of every beam); got {body.n}.", "n")
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            why = _WHY.get(name, "beam search ranks the model's own logprobs")
            raise bad_request(f"{name}: {value!r} cannot be honoured with use_beam_search: {why}.", name)
    refused = {"tools": getattr(body, "tools", None), "logit_bias": body.logit_bias,
               "structured_outputs": body.structured_outputs,
               "response_format": body.response_format if body.response_format is not None
               and body.response_format.type != "text" else None}
    for name, value in refused.items():
        if value is not None:
            raise bad_request(f"{name} cannot be honoured with use_beam_search: not implemented.", name)
    return True


@lru_cache(maxsize=4)
def _eos_ids(model_root: str | None, tokenizer_eos: int | None) -> frozenset[int]:
    class _Tokenizer:
        eos_token_id = tokenizer_eos

    # The engine's own rule (the tokenizer's EOS and generation_config.json's).
    return frozenset(eos_token_ids(_Tokenizer(), Path(model_root or "/nonexistent")))


async def _final(stream: RequestStream) -> RequestOutput:
    parts: list[RequestOutput] = []
    while True:
        output = await stream.next()
        if output is None:
            raise APIError(499, "Client disconnected.", "invalid_request_error")
        if output.error is not None:
            raise bad_request(str(output.error))
        parts.append(output)
        if output.finished:
            return merge_deltas(parts)


async def _search(server: OpenAIServer, prepared: Prepared, states: list[BeamSearchState],
                  live_streams: list[RequestStream], stop: StopCheck, gone: list[bool], num_top: int) -> None:
    width = states[0].beam_width
    # The search reads each step's top 2n; a request's logprobs may show more (both at most 20).
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=max(2 * width, num_top), ignore_eos=True)
    turn = 0
    while not all(state.done for state in states) and not gone:
        live = [(index, state) for index, state in enumerate(states) if not state.done]
        requests = [(f"{prepared.request_id}-beam{turn}-{index}-{k}", prepared.prompts[index] + list(beam.tokens),
                     step, prepared.cache_salt)
                    for index, state in live for k, beam in enumerate(state.live)]
        turn += 1
        try:
            streams = await server.engine.add_requests(requests, tenant=REQUEST_TENANT.get(),
                                                       lora_name=prepared.lora_name, priority=prepared.priority)
        except (ValueError, TypeError, OverflowError) as exc:
            raise bad_request(str(exc)) from exc
        live_streams[:] = streams  # what a disconnect aborts
        if gone:
            raise APIError(499, "Client disconnected.", "invalid_request_error")
        try:
            outputs = iter([await _final(stream) for stream in streams])
        finally:
            server.release(streams)
        for _, state in live:
            candidates, steps = [], []
            for _beam in state.live:
                positions = next(outputs).outputs[0].logprobs or [{}]
                candidates.append(top_candidates({t: lp.logprob for t, lp in positions[0].items()},
                                                 state.num_logprobs))
                steps.append(positions[0])  # each beam's logprobs, for a request that asks for them
            beam_step(state, candidates, stop, steps)
    if gone:
        raise APIError(499, "Client disconnected.", "invalid_request_error")


def _choice_text(server: OpenAIServer, body: p.SamplingFields, beam: Beam) -> tuple[str, int]:
    """The beam's text (a stop token or string left out unless include_stop_str_in_output), and its
    token count."""
    tokens = list(beam.tokens)
    if beam.finish_reason == "stop" and isinstance(beam.stop_reason, int) and not body.include_stop_str_in_output:
        tokens = tokens[:-1]
    text = server.tokenizer.decode(tokens, skip_special_tokens=body.skip_special_tokens)
    if isinstance(beam.stop_reason, str):
        at = text.find(beam.stop_reason)
        text = text[:at + len(beam.stop_reason)] if body.include_stop_str_in_output else text[:at]
    return text, len(beam.tokens)


@dataclass
class BeamChoice:
    """One beam as a choice: its text (what ended it left out, as in sampling), outcome, and its
    generated tokens (the stop token too, as sampling counts it) with each step's top logprobs."""

    text: str
    num_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int]
    positions: list[PositionLogprobs]


async def search(server: OpenAIServer, body: p.SamplingFields, prepared: Prepared,
                 request: Request, num_top: int = 0) -> list[list[BeamChoice]]:
    """Each prompt's n best beams, best first; ``num_top``: the top logprobs the answer shows."""
    penalty = 1.0 if body.length_penalty is None else float(body.length_penalty)
    states = [BeamSearchState(body.n, params.max_tokens or 1, penalty) for params in prepared.params]
    eos = set() if body.ignore_eos else set(_eos_ids(server.model_root, server.tokenizer.eos_token_id))
    stop_strings: Sequence[str] = prepared.params[0].stop

    def decode(tokens: list[int]) -> str:
        return server.tokenizer.decode(tokens, skip_special_tokens=body.skip_special_tokens)

    stop = stop_on(eos, prepared.params[0].stop_token_ids, stop_strings, decode)
    live_streams: list[RequestStream] = []
    gone: list[bool] = []

    def on_disconnect() -> None:
        gone.append(True)  # a step being added now is released as soon as its streams exist
        server.release(live_streams)

    watcher = asyncio.ensure_future(watch_disconnect(request, on_disconnect))
    try:
        await _search(server, prepared, states, live_streams, stop, gone, num_top)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    finally:
        watcher.cancel()
        server.release(live_streams)
    answers: list[list[BeamChoice]] = []
    for state in states:
        answers.append([])
        for beam in state.best():
            text, count = _choice_text(server, body, beam)
            # EOS is no stop token: null, as sampling reports it.
            stop_reason = None if beam.stop_reason in eos and beam.stop_reason not in (
                body.stop_token_ids or ()) else beam.stop_reason
            answers[-1].append(BeamChoice(text, count, beam.finish_reason, stop_reason, list(beam.tokens),
                                          [cast(PositionLogprobs, step) for step in beam.steps]))
    return answers


LogprobsOf = Callable[[BeamChoice], Any]  # a beam's logprobs in the endpoint's form, or None


def _admit(server: OpenAIServer, body: p.SamplingFields, prepared: Prepared) -> dict[str, Any]:
    """The checks before a search starts (a streamed one's too: before its 200); the answer's head."""
    server.check_capacity(body.n * len(prepared.prompts))
    if prepared.lora_name and prepared.lora_name not in server.lora_modules:
        server.check_model(prepared.lora_name)
    return {"id": prepared.request_id, "created": int(time.time()), "model": body.model or server.model_name}


async def beam_completion(server: OpenAIServer, body: p.CompletionRequest, prepared: Prepared, request: Request,
                          logprobs_of: LogprobsOf) -> p.CompletionResponse | StreamingResponse:
    """The n best beams of each prompt as choices, best first (choice index: prompt x n + rank)."""
    head = _admit(server, body, prepared)

    async def answer() -> p.CompletionResponse:
        answers = await search(server, body, prepared, request, body.logprobs or 0)
        choices = [p.CompletionChoice(index=index * body.n + rank, text=beam.text, logprobs=logprobs_of(beam),
                                      finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
                   for index, beams in enumerate(answers) for rank, beam in enumerate(beams)]
        completion_tokens = sum(beam.num_tokens for beams in answers for beam in beams)
        prompt_tokens = sum(len(ids) for ids in prepared.prompts)
        return p.CompletionResponse(**head, choices=choices, usage=p.Usage(**usage(prompt_tokens, completion_tokens, 0)))

    if body.stream:
        return _streamed(body, head, "text_completion", [], answer(), lambda c: c)
    return await answer()


async def beam_chat_completion(server: OpenAIServer, body: p.ChatCompletionRequest, prepared: Prepared,
                               request: Request, logprobs_of: LogprobsOf) -> p.ChatCompletionResponse | StreamingResponse:
    """The conversation's n best beams as the choices' messages, best first."""
    head = _admit(server, body, prepared)

    async def answer() -> p.ChatCompletionResponse:
        (beams,) = await search(server, body, prepared, request, (body.top_logprobs or 0) if body.logprobs else 0)
        choices = [p.ChatChoice(index=rank, message=p.ChatResponseMessage(content=beam.text, tool_calls=[]),
                                logprobs=logprobs_of(beam) if body.logprobs else None,
                                finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
                   for rank, beam in enumerate(beams)]
        completion_tokens = sum(beam.num_tokens for beam in beams)
        return p.ChatCompletionResponse(**head, choices=choices,
                                        usage=p.Usage(**usage(len(prepared.prompts[0]), completion_tokens, 0)))

    def delta(choice: dict) -> dict:
        message = choice.pop("message")
        return {**choice, "delta": {"content": message["content"]}}

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} for i in range(body.n)]
    if body.stream:
        return _streamed(body, head, "chat.completion.chunk", opening, answer(), delta)
    return await answer()


def _streamed(body: p.SamplingFields, head: dict[str, Any], object_name: str, opening: list[dict],
              answer: Awaitable[Any], as_delta: Callable[[dict], dict]) -> StreamingResponse:
    """A streamed beam search, as vLLM's chat streams one: the beams are known only when the search
    ends, so each choice comes whole in one chunk at the end (after chat's role chunk), then usage."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(head: dict, choices: list[dict], usage_: dict | None = None) -> str:
        payload = {**head, "object": object_name, "choices": choices}
        if include_usage:
            payload["usage"] = usage_
        return sse(payload)

    async def events() -> AsyncIterator[str]:
        try:
            if opening:
                yield chunk(head, opening)
            response = (await answer).model_dump()
            for choice in response["choices"]:
                yield chunk(head, [as_delta(choice)])
            if include_usage:
                yield chunk(head, [], response["usage"])
        except APIError as exc:
            yield sse(p.error_body(exc.message, exc.err_type, param=exc.param, code=exc.code))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")
