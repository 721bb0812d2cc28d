"""A streamed Responses answer: chat's stream (its formatter finds text and tool calls in the
engine's deltas) as the Responses API's semantic events, in OpenAI's order, each with its
``sequence_number`` (docs/server.md "The Responses API").

``response.created``, ``response.in_progress``; per text: ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per tool call:
``response.output_item.added``, ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the answer,
``response.failed`` when the engine died). Server-sent events with an ``event:`` line, no
``[DONE]``, as OpenAI sends them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from kvscale.server.engine.engine_front import EngineDeadError, RequestStream
from kvscale.server.entrypoints.responses_output import (
    ResponseHead,
    event_logprobs,
    function_call_item,
    message_item,
    new_id,
    part_logprobs,
    responses_usage,
    text_part,
)
from kvscale.server.entrypoints.serving import OpenAIServer
from kvscale.server.entrypoints.serving_chat import ChatFormatter
from kvscale.server.entrypoints.serving_streams import merged, watch_disconnect
from kvscale.server.outputs import RequestOutput


class ResponseEvents:
    """The events of one response, from chat's stream choices (``ChatFormatter.choices``)."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.message_index: int | None = None  # the open message item's output index
        self.calls: dict[int, int] = {}  # chat's tool-call index -> output index
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        snapshot = self.head.body_of("in_progress", [])
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def on_choice(self, choice: dict[str, Any]) -> list[str]:
        out: list[str] = []
        delta = choice.get("delta") or {}
        # Logprobs of tokens that add no text (an end-of-sequence token) go in a delta with no text,
        # so that the deltas' logprobs are the whole part's, as the non-streamed answer has them.
        logprobs = part_logprobs(choice.get("logprobs"))
        if delta.get("content") or logprobs:
            out += self._text(delta.get("content") or "", logprobs)
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return out

    def _open_message(self) -> list[str]:
        self.message_index = len(self.items)
        item = message_item(new_id("msg"), None, "in_progress")
        self.items.append(item)
        added = self.event("response.output_item.added", output_index=self.message_index, item=dict(item, content=[]))
        item["content"].append(text_part(""))
        return [added, self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self.message_index, content_index=0, part=text_part(""))]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        out = self._open_message() if self.message_index is None else []
        assert self.message_index is not None
        item = self.items[self.message_index]
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.message_index,
                              content_index=0, delta=text, logprobs=event_logprobs(logprobs)))
        return out

    def _close_message(self, status: str) -> list[str]:
        if self.message_index is None:
            return []
        index, self.message_index = self.message_index, None
        item = self.items[index]
        part = item["content"][0]
        item["status"] = status
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=event_logprobs(part["logprobs"])),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        function = call.get("function") or {}
        if call["index"] not in self.calls:  # its first delta: id and name
            out += self._close_message("completed")  # text comes before a call, never after
            self.calls[call["index"]] = len(self.items)
            item = function_call_item(new_id("fc"), call["id"], function.get("name", ""), "", "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=self.calls[call["index"]],
                                  item=dict(item)))
        index = self.calls[call["index"]]
        item = self.items[index]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=index, delta=function["arguments"]))
        return out

    def closing(self, chat_usage: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """The closing events and the finished response (its last event not yet among them)."""
        incomplete = self.finish_reason == "length"
        # An empty answer is still a message, as in the non-streamed form.
        out = self._open_message() if not self.items else []
        out += self._close_message("incomplete" if incomplete else "completed")
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        response = self.head.body_of("incomplete" if incomplete else "completed", self.items,
                                     responses_usage(chat_usage),
                                     "max_output_tokens" if incomplete else None)
        return out, response

    def last(self, response: dict[str, Any]) -> str:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=response)

    def failed(self, message: str) -> str:
        error = {"code": "server_error", "message": message}
        return self.event("response.failed", response=self.head.body_of("failed", self.items, error=error))


async def response_events(server: OpenAIServer, streams: list[RequestStream], request: Request,
                          formatter: ChatFormatter, events: ResponseEvents,
                          first: list[RequestOutput | None] | None,
                          on_done: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[str]:
    """The stream's events; ``on_done`` (storing) runs on the finished response before its last
    event goes out, so a client that reads ``response.completed`` can continue from it at once."""
    watcher = asyncio.ensure_future(watch_disconnect(request, lambda: server.release(streams)))
    try:
        for line in events.opening():
            yield line
        async for prompt_index, output in merged(streams, first):
            if output is None:
                return  # aborted: the client is gone
            for choice in formatter.choices(prompt_index, output):
                for line in events.on_choice(choice):
                    yield line
        lines, response = events.closing(formatter.usage())
        for line in lines:
            yield line
        await on_done(response)
        yield events.last(response)
    except EngineDeadError as exc:
        yield events.failed(str(exc))
    finally:
        watcher.cancel()
        server.release(streams)
