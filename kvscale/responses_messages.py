"""A Responses request's input items and function tools as chat's, from their JSON: the one
conversion the server carries a request out with and the router predicts its prompt by
(docs/server.md "The Responses API").

A ``message`` item is a chat message (its text parts as chat's ``text`` parts), a
``function_call`` item joins the assistant message before it as a tool call (or opens one), a
``function_call_output`` item is a ``tool`` message; a flat function tool is wrapped as chat's
``{"type": "function", "function": ...}``, ``strict`` unless it says otherwise (the Responses
API's default). The server validates each item and tool (and answers 400 naming what it cannot
honour) before converting; the router converts what it is sent, and a shape it cannot convert
raises ``Unreadable``.
"""

from __future__ import annotations

from typing import Any

# Bounds no real conversation meets, so that a request's item list cannot cost the front end more
# than its body limit's worth of small objects (docs/server.md "Request limits"). The server's
# request schema refuses more with a 400; the router, reading the same lists, stops at them too.
MAX_INPUT_ITEMS = 4096
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 1024  # the list's length before parsing; the served limit is --max-tools
MAX_RESPONSE_ID_CHARS = 128  # response and call ids
_TOOL_FIELDS = ("name", "description", "parameters", "strict")


class Unreadable(ValueError):
    """Input or tools of a shape the conversion does not take."""


def text_content(content: Any) -> str | list[dict[str, Any]]:
    """A string, or text parts as chat's ``text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or len(content) > MAX_CONTENT_PARTS:
        raise Unreadable("content")
    parts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise Unreadable("content part")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The request's ``input`` (a string or a list of items) as chat messages."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or len(items) > MAX_INPUT_ITEMS:
        raise Unreadable("input")
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise Unreadable("input item")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": text_content(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_content(item.get("output"))})
        else:
            raise Unreadable("input item type")
    return messages


def chat_tool(tool: Any) -> dict[str, Any]:
    """One flat function tool as chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise Unreadable("tool")
    definition = {name: tool[name] for name in _TOOL_FIELDS if tool.get(name) is not None}
    definition.setdefault("strict", True)
    return {"type": "function", "function": definition}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools as chat's; None for none."""
    if not tools:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise Unreadable("tools")
    return [chat_tool(tool) for tool in tools]
