"""POST /v1/completions: prompts (strings or token ids, one or several) to text.

Choice index = prompt index x n + sample index. ``echo`` puts the prompt in front of the first
chunk of each choice; with ``logprobs`` it carries the prompt's logprobs too (what scoring
harnesses read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvscale.server.engine.engine_front import RequestStream
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.admission import resolve_max_tokens
from kvscale.server.entrypoints.lora_modules import lora_name_of
from kvscale.server.entrypoints.refused_fields import check_refused_fields
from kvscale.server.entrypoints.request_priority import request_priority
from kvscale.server.entrypoints.response_parts import top_entries, usage
from kvscale.server.entrypoints.serving import (
    OpenAIServer,
    Prepared,
    bad_request,
    check_stream_options,
    logit_bias_from,
    sampling_params_from,
    structured_outputs_from,
)
from kvscale.server.entrypoints.serving_beam import BeamChoice, beam_completion
from kvscale.server.entrypoints.serving_streams import (
    ChoiceState,
    StreamFormatter,
    collect,
    first_outputs_while_connected,
    stream_events,
    until_disconnect,
)
from kvscale.server.outputs import CompletionOutput, PositionLogprobs
from kvscale.server.sampling_params import SamplingParams
from kvscale.tokenization import completion_prompt_token_ids


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts (one engine request each)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    if prompt and isinstance(prompt[0], list):
        return [list(ids) for ids in prompt]
    return [list(prompt)]


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
            top = {lp.decoded_token: lp.logprob for _, lp in top_entries(position, num_top)}
            if chosen is not None:
                top.setdefault(token, chosen.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def choice_index(prompt_index: int, n: int, output_index: int) -> int:
    return prompt_index * n + output_index


def prepare_completion(server: OpenAIServer, body: p.CompletionRequest) -> Prepared:
    server.check_model(body.model)
    check_stream_options(body)
    check_refused_fields(body)
    server.note_unknown_fields(body, "/v1/completions")
    requested = completion_prompts(body.prompt)
    server.check_prompt_count(len(requested))  # before tokenizing any of them
    server.check_field_limits(body, len(requested))  # before parsing or copying any field
    structured, constraint_param = structured_outputs_from(server, body)
    server.check_constraint_size(structured, constraint_param)
    if structured is not None:
        server.count_structured(structured.kind)
    logit_bias = logit_bias_from(body, server.vocab_size)
    prompts, echo_texts = [], []
    params: list[SamplingParams] = []
    # echo with logprobs returns the prompt tokens' logprobs too (what scoring harnesses use).
    prompt_logprobs = body.logprobs if body.echo else None
    for prompt in requested:
        ids = completion_prompt_token_ids(server.tokenizer, prompt)
        server.check_prompt(ids)
        try:
            max_tokens = resolve_max_tokens(body.max_tokens, len(ids), server.max_model_len)
            # One SamplingParams built and checked; the other prompts share its request-wide
            # fields (engine_core_wire.py sends them to the core once).
            params.append(params[0].with_max_tokens(max_tokens) if params else sampling_params_from(
                body, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured, logit_bias=logit_bias))
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None)) from exc
        prompts.append(ids)
        if body.echo:
            echo_texts.append(prompt if isinstance(prompt, str) else server.tokenizer.decode(ids))
        else:
            echo_texts.append("")
    return Prepared(p.random_id("cmpl"), prompts, echo_texts, params, body.cache_salt, constraint_param,
                    stream_interval=body.stream_interval, lora_name=lora_name_of(server.lora_modules, body.model),
                    priority=request_priority(server, body))


def _with_echo(server: OpenAIServer, num_top: int, prompt_ids: list[int],
               prompt_logprobs: Sequence[PositionLogprobs | None] | None,
               generated: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """The prompt's tokens and logprobs (offsets from 0), followed by the generated ones."""
    echoed = completion_logprobs(prompt_ids, prompt_logprobs or [], num_top, 0, server.decode_one)
    return p.CompletionLogprobs(
        tokens=echoed.tokens + generated.tokens,
        token_logprobs=echoed.token_logprobs + generated.token_logprobs,
        top_logprobs=echoed.top_logprobs + generated.top_logprobs,
        text_offset=echoed.text_offset + generated.text_offset,
    )


class CompletionFormatter(StreamFormatter):
    object_name = "text_completion"
    body: p.CompletionRequest

    def choice(self, prompt_index: int, completion: CompletionOutput, state: ChoiceState) -> dict | None:
        echo = self.prepared.echo_texts[prompt_index]
        first = not state.started
        text = "".join(state.text)
        if not text and not completion.finished and not (first and echo):
            return None
        logprobs = None
        if self.body.logprobs is not None and completion.logprobs is not None:
            generated = completion_logprobs(state.token_ids, state.logprobs, self.body.logprobs,
                                            len(echo) + state.text_sent, self.server.decode_one)
            if first and echo:
                generated = _with_echo(self.server, self.body.logprobs, self.prepared.prompts[prompt_index],
                                       self.prompt_logprobs[prompt_index], generated)
            logprobs = generated.model_dump()
        state.sent(text)
        return {"index": choice_index(prompt_index, self.body.n, completion.index),
                "text": (echo if first else "") + text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


async def _respond(server: OpenAIServer, body: p.CompletionRequest, prepared: Prepared,
                   streams: list[RequestStream]) -> p.CompletionResponse:
    outputs = await collect(server, streams, prepared)
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
                    logprobs = _with_echo(server, body.logprobs, prepared.prompts[prompt_index], output.prompt_logprobs,
                                          logprobs)
            choices.append(p.CompletionChoice(
                index=choice_index(prompt_index, body.n, completion.index), text=echo + completion.text,
                logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            ))
    return p.CompletionResponse(id=prepared.request_id, model=body.model or server.model_name, choices=choices,
                                usage=p.Usage(**usage(prompt_tokens, completion_tokens, cached)))


async def create_completion(server: OpenAIServer, body: p.CompletionRequest, request: Request) -> p.CompletionResponse | StreamingResponse:
    prepared = prepare_completion(server, body)
    if body.use_beam_search:  # docs/server.md, "Beam search"
        def beam_logprobs(beam: BeamChoice) -> p.CompletionLogprobs | None:
            if body.logprobs is None:
                return None
            return completion_logprobs(beam.token_ids, beam.positions, body.logprobs, 0, server.decode_one)

        return await beam_completion(server, body, prepared, request, beam_logprobs)
    streams = await server.open_streams(prepared)
    if body.stream:
        formatter = CompletionFormatter(server, body, prepared)
        # The 200 waits for the first token: a constrained request may be refused before it, and a
        # gateway retries a request its replica dropped only while no response has started
        # (docs/gateway.md, "When a replica dies").
        first = await first_outputs_while_connected(request, server, streams, prepared)
        return StreamingResponse(stream_events(server, streams, request, formatter, first),
                                 media_type="text/event-stream")
    return await until_disconnect(request, server, streams, _respond(server, body, prepared, streams))
