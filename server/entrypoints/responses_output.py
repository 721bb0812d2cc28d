"""A chat answer as the Responses API returns it: output items (a ``message`` with one
``output_text`` part, a ``function_call`` per tool call), the ``usage`` object, and the response
object around them (docs/server.md "The Responses API")."""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvscale.server.entrypoints.protocol_responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def part_logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chat's logprobs (a ``ChatLogprobs`` as JSON) as an ``output_text`` part carries them: the
    same entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``), listed flat."""
    return list((chat_logprobs or {}).get("content") or [])


def event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A part's logprob entries as the text events carry them: OpenAI's delta and done events
    have no ``bytes``."""
    return [{"token": entry["token"], "logprob": entry["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]]}
            for entry in entries]


def message_item(item_id: str, text: str | None, status: str,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(content: str | None, tool_calls: list[dict[str, Any]], incomplete: bool,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A whole answer's items: its text (also when empty and there is no call), then its calls."""
    items = []
    if content or not tool_calls:
        items.append(message_item(new_id("msg"), content or "", "incomplete" if incomplete else "completed",
                                  logprobs))
    for call in tool_calls:
        function = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"],
                                        "completed"))
    return items


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the chat message the next turn's conversation holds."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names."""
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # The openai client's types require cache_write_tokens (input written to OpenAI's prompt cache
        # with a retention); the prefix cache here keeps computed blocks on its own, written by no request.
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponseHead:
    """What every copy of one response carries (the created event's, the stored one)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def body_of(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                incomplete_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None,
            "service_tier": body.service_tier, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                     else {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key, "metadata": body.metadata or {},
        }
