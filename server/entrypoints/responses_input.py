"""A Responses request read into the chat request that carries it out: one implementation
underneath (docs/server.md "The Responses API").

Input items become chat messages (a ``function_call`` item joins the assistant message before
it as a tool call, a ``function_call_output`` item is a ``tool`` message), ``instructions`` a
system message in front, flat function tools chat's ``{"type": "function", "function": ...}``,
``text.format`` chat's ``response_format``. Whatever the server cannot honour is a 400 naming the
field, and the item's position where it is one of many.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from kvscale import request_limits
from kvscale import responses_messages as conversion
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.protocol_responses import (
    OUTPUT_LOGPROBS,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)
from kvscale.server.entrypoints.serving import APIError, bad_request


def _set(value: Any) -> bool:
    return value is not None


def _reasoning_set(value: Any) -> bool:
    """Reasoning asked of a model that has none; effort "none" asks for none, and is honoured."""
    return isinstance(value, dict) and any(v is not None and not (key == "effort" and v == "none")
                                           for key, v in value.items())


# Fields of OpenAI's Responses API this server cannot carry out: refused when set, never ignored.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: v is True, "background responses are not supported: each response "
                   "is answered on its own request"),
    "reasoning": (_reasoning_set, "the served model has no reasoning mode"),
    "conversation": (_set, "conversation objects are not supported; use previous_response_id"),
    "prompt": (_set, "stored prompt templates are not supported"),
    "max_tool_calls": (_set, "a cap on tool calls is not supported; use parallel_tool_calls: false "
                       "for one call"),
    "truncation": (lambda v: v == "auto", "the server never drops conversation items: a "
                   "conversation longer than the context is a 400"),
    "context_management": (_set, "context management (compaction) is not supported"),
    "background_options": (_set, "background responses are not supported"),
    "moderation": (_set, "moderation is not available"),
    "image": (_set, "image input is not supported: the served model reads text only"),
    "access_programs": (_set, "access programs are not supported"),
    "prompt_cache_options": (_set, "prompt caching is automatic here and takes no options"),
    "prompt_cache_retention": (_set, "the prefix cache's retention is the server's, not the request's"),
}


def wants_logprobs(body: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (body.include or ())


def _check_include(body: ResponsesRequest) -> None:
    """``include`` asks for extra output data: the output text's logprobs are the only data this
    server has (no built-in tools, images or reasoning items to add)."""
    unknown = sorted({value for value in body.include or () if value != OUTPUT_LOGPROBS})
    if unknown:
        names = ", ".join(repr(value[:64]) for value in unknown[:8])
        raise bad_request(f"include cannot be honoured for {names}: the only extra output data this server "
                          f"has is {OUTPUT_LOGPROBS!r}.", "include")
    if body.top_logprobs and not wants_logprobs(body):
        raise bad_request(f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}]: without it no logprobs are "
                          "returned.", "top_logprobs")
    if wants_logprobs(body) and body.tools and body.tool_choice != "none":
        # Calls are cut out of the generated tokens, so the text's tokens are not the answer's.
        raise bad_request(f"include {OUTPUT_LOGPROBS!r} cannot be honoured with function tools that may be "
                          'called; set tool_choice to "none" or leave the tools out.', "include")


def check_refused(body: ResponsesRequest) -> None:
    for name, (is_set, why) in REFUSED.items():
        if is_set(getattr(body, name)):
            raise bad_request(f"{name} cannot be honoured by this server: {why}.", name)
    _check_include(body)
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request("stream_options.include_obfuscation cannot be honoured: this server does "
                          "not pad stream events.", "stream_options.include_obfuscation")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity cannot be honoured: the served model has no verbosity "
                          "setting.", "text.verbosity")


def _parse(model: type[BaseModel], value: Any, param: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{param}{'.' + where if where else ''}: {first.get('msg')}", param) from exc


def _check_text_parts(parts: str | list[ContentPart], allowed: tuple[str, ...], param: str) -> None:
    """A part of another kind than ``allowed`` (an image, a file) is refused."""
    if isinstance(parts, str):
        return
    for index, part in enumerate(parts):
        if part.type not in allowed or part.text is None:
            raise bad_request(f"{param}[{index}] is a {part.type!r} part; this server takes "
                              f"{' or '.join(allowed)} parts only (the served model reads text).",
                              f"{param}[{index}]")


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's input items as chat messages (as JSON, the form the router renders too):
    each item checked, then converted by kvscale.responses_messages, the conversion the router
    predicts the prompt with."""
    if isinstance(items, list):
        for index, item in enumerate(items):
            param = f"input[{index}]"
            kind = item.get("type", "message")
            if kind == "message":
                message = _parse(MessageItem, item, param)
                allowed = ("output_text", "input_text") if message.role == "assistant" else ("input_text",)
                _check_text_parts(message.content, allowed, f"{param}.content")
            elif kind == "function_call":
                _parse(FunctionCallItem, item, param)
            elif kind == "function_call_output":
                result = _parse(FunctionCallOutputItem, item, param)
                _check_text_parts(result.output, ("input_text",), f"{param}.output")
            else:
                raise bad_request(f"{param} is a {str(kind)[:64]!r} item; this server takes message, "
                                  "function_call and function_call_output items.", param)
    return conversion.input_messages(items)


def chat_tools(body: ResponsesRequest, limits: request_limits.FieldLimits) -> list[dict] | None:
    if not body.tools:
        return None
    try:  # counted before any tool is read (docs/server.md "Request limits")
        request_limits.check_sampling_fields(limits, stop=[], stop_token_ids=0, logit_bias=0,
                                             tools=len(body.tools))
    except request_limits.LimitExceeded as exc:
        raise bad_request(exc.message, exc.param) from exc
    for index, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools[{index}] is the built-in tool {str(kind)[:64]!r}, which this server "
                              "does not have; only function tools are supported.", f"tools[{index}]")
        _parse(FunctionTool, tool, f"tools[{index}]")
    return conversion.chat_tools(body.tools)


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise bad_request(f"tool_choice {str(kind)[:64]!r} cannot be honoured: this server takes \"none\", "
                      '"auto", "required" or {"type": "function", "name": ...}.', "tool_choice")


def chat_response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs schema.", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]],
                 limits: request_limits.FieldLimits) -> tuple[p.ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request carrying out ``body`` after the stored ``history``, and the conversation
    to store (``instructions`` left out: OpenAI does not carry them to the next turn). The
    request has passed ``check_refused``."""
    conversation = [*history, *input_messages(body.input)]
    if not any(message["role"] != "assistant" for message in conversation):
        raise bad_request("input is empty: give a string or at least one message item.", "input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": [*system, *conversation], "temperature": body.temperature,
        "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens, "stream": body.stream,
        "tools": chat_tools(body, limits), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": chat_response_format(body),
        "priority": body.priority,
    }
    if wants_logprobs(body):  # chat's logprobs, returned as the output_text part's
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    try:
        chat = p.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", where or None) from exc
    return chat, conversation


def not_found(response_id: str, param: str | None = None, status: int = 404) -> APIError:
    if param == "previous_response_id":
        message, code = f"previous_response_id {response_id[:128]!r} names no response stored here.", \
            "previous_response_not_found"
    else:
        message, code = f"No response with id {response_id[:128]!r} is stored here.", "not_found"
    return APIError(status, message, "invalid_request_error", param=param, code=code)
