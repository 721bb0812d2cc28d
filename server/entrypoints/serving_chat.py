"""POST /v1/chat/completions: messages through the chat template to an assistant turn.

Streams open with a chunk carrying ``delta.role = "assistant"`` per choice, as OpenAI sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
from kvscale.server.entrypoints.serving_beam import beam_chat_completion
from kvscale.server.entrypoints.serving_streams import (
    ChoiceState,
    StreamFormatter,
    collect,
    first_outputs_while_connected,
    stream_events,
    until_disconnect,
)
from kvscale.server.entrypoints.serving_tools import (
    ToolError,
    ToolPlan,
    ToolStream,
    finished_message,
    plan_tools,
)
from kvscale.server.outputs import CompletionOutput, PositionLogprobs
from kvscale.tokenization import chat_prompt_token_ids


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
                for _, lp in top_entries(position, num_top)
            ],
        ))
    return p.ChatLogprobs(content=content)


def chat_ids(server: OpenAIServer, messages: list[p.ChatMessage], tools: list[p.Tool] | None = None) -> list[int]:
    """The prompt's token ids (also what POST /tokenize answers for ``messages``)."""
    # Back to the JSON the client sent: the router tokenizes that very form of the messages.
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    tool_json = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        return chat_prompt_token_ids(server.tokenizer, conversation, tool_json, server.tool_call_parser or "hermes")
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    except Exception as exc:  # jinja raises its own errors for conversations it rejects
        raise bad_request(f"The chat template rejected these messages: {exc}", "messages") from exc


def prepare_chat(server: OpenAIServer, body: p.ChatCompletionRequest) -> Prepared:
    server.check_model(body.model)
    check_stream_options(body)
    check_refused_fields(body)
    server.note_unknown_fields(body, "/v1/chat/completions")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    server.check_field_limits(body, 1, tools=len(body.tools or ()))  # before parsing any field
    try:
        plan = plan_tools(body, parser=server.tool_call_parser, auto_enabled=server.enable_auto_tool_choice)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from exc
    structured, constraint_param = structured_outputs_from(server, body)
    if plan.constraint is not None:
        structured, constraint_param = plan.constraint, "tools"
        server.count_structured("tool")
    elif structured is not None:
        server.count_structured(structured.kind)
    server.check_constraint_size(structured, constraint_param)
    logit_bias = logit_bias_from(body, server.vocab_size)
    ids = chat_ids(server, body.messages, body.tools)
    server.check_prompt(ids, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        max_tokens = resolve_max_tokens(requested, len(ids), server.max_model_len)
        params = sampling_params_from(body, max_tokens=max_tokens, logprobs=logprobs,
                                      structured_outputs=structured, logit_bias=logit_bias)
    except ValueError as exc:
        raise bad_request(str(exc), getattr(exc, "param", None)) from exc
    return Prepared(p.random_id("chatcmpl"), [ids], [""], [params], body.cache_salt, constraint_param, plan,
                    stream_interval=body.stream_interval, lora_name=lora_name_of(server.lora_modules, body.model),
                    priority=request_priority(server, body))


class ChatFormatter(StreamFormatter):
    object_name = "chat.completion.chunk"
    body: p.ChatCompletionRequest

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan: ToolPlan | None = self.prepared.tools
        self.tool_streams: dict[int, ToolStream] = {}

    def opening(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(self.body.n)]

    def choice(self, prompt_index: int, completion: CompletionOutput, state: ChoiceState) -> dict | None:
        text = "".join(state.text)
        if not text and not completion.finished:
            return None
        if self.plan is not None and self.plan.mode is not None:
            return self._tool_choice(completion, state, text)
        logprobs = self._logprobs(state)
        state.sent(text)
        return {"index": completion.index, "delta": {"content": text} if text else {},
                "logprobs": logprobs, "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def _logprobs(self, state: ChoiceState) -> dict | None:
        """The logprobs of the tokens a chunk carries (those since the last chunk went out)."""
        if not self.body.logprobs or not state.token_ids:
            return None
        return chat_logprobs(state.token_ids, state.logprobs, self.body.top_logprobs or 0,
                             self.server.decode_one).model_dump()

    def _tool_choice(self, completion: CompletionOutput, state: ChoiceState, text: str) -> dict | None:
        plan = self.plan
        assert plan is not None
        stream = self.tool_streams.setdefault(completion.index, ToolStream())
        finish = completion.finish_reason
        content, calls = stream.step(plan, text, finished=finish is not None)
        if stream.failed and finish is not None:
            self.server.count_tool_parse_failure()
        if finish == "stop" and stream.ids:
            finish = "tool_calls"
        if not content and not calls and finish is None:
            state.held()  # the parser holds the text; its tokens' logprobs go with the next chunk
            return None
        logprobs = self._logprobs(state)
        state.sent(text)
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return {"index": completion.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": completion.stop_reason}


async def _respond(server: OpenAIServer, body: p.ChatCompletionRequest, prepared: Prepared,
                   streams: list[RequestStream]) -> p.ChatCompletionResponse:
    (output,) = await collect(server, streams, prepared)
    choices = []
    completion_tokens = 0
    for completion in sorted(output.outputs, key=lambda c: c.index):
        completion_tokens += len(completion.token_ids)
        logprobs = None
        if body.logprobs and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0,
                                     server.decode_one)
        content: str | None = completion.text
        tool_calls: list = []
        finish = completion.finish_reason
        if prepared.tools is not None:
            content, tool_calls, finish = finished_message(prepared.tools, completion.text, finish,
                                                           server.count_tool_parse_failure)
        choices.append(p.ChatChoice(
            index=completion.index, message=p.ChatResponseMessage(content=content, tool_calls=tool_calls),
            logprobs=logprobs, finish_reason=finish, stop_reason=completion.stop_reason,
        ))
    usage_ = usage(len(prepared.prompts[0]), completion_tokens, output.num_cached_tokens)
    return p.ChatCompletionResponse(id=prepared.request_id, model=body.model or server.model_name,
                                    choices=choices, usage=p.Usage(**usage_))


async def create_chat_completion(server: OpenAIServer, body: p.ChatCompletionRequest, request: Request):
    prepared = prepare_chat(server, body)
    if body.use_beam_search:  # docs/server.md, "Beam search"
        return await beam_chat_completion(server, body, prepared, request, lambda beam: chat_logprobs(
            beam.token_ids, beam.positions, body.top_logprobs or 0, server.decode_one))
    streams = await server.open_streams(prepared)
    if body.stream:
        formatter = ChatFormatter(server, body, prepared)
        # The 200 waits for the first token: a constrained request may be refused before it, and a
        # gateway retries a request its replica dropped only while no response has started
        # (docs/gateway.md, "When a replica dies").
        first = await first_outputs_while_connected(request, server, streams, prepared)
        return StreamingResponse(stream_events(server, streams, request, formatter, first),
                                 media_type="text/event-stream")
    return await until_disconnect(request, server, streams, _respond(server, body, prepared, streams))
