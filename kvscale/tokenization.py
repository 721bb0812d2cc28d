"""The one place where a request's prompt becomes token ids.

The server and the router both call these, so a prompt maps to the same ids (and so the same
KV block hashes) on both sides. A change here changes routing; keep them in lockstep.
"""

from __future__ import annotations

import json
from typing import Any


def completion_prompt_token_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of a /v1/completions prompt: a string is encoded with the tokenizer's special
    tokens (as vLLM does); a list of ids is taken as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return [int(token_id) for token_id in prompt]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any) -> str:
    """A message's content as the template sees it: a string as is, text parts joined, null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("message content must be a string, a list of text parts, or null")


TOOL_FORMATS = ("hermes", "llama3_json")


def tool_definitions(tools: Any) -> list[dict]:
    """The request's ``tools`` reduced to what a prompt shows (type, name, description,
    parameters): the server's validated tools and the router's raw JSON render alike."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    defs = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("each tool needs a function with a name")
        shown: dict[str, Any] = {"name": function["name"]}
        if isinstance(function.get("description"), str):
            shown["description"] = function["description"]
        if isinstance(function.get("parameters"), dict):
            shown["parameters"] = function["parameters"]
        defs.append({"type": "function", "function": shown})
    return defs


def tool_call_text(name: str, arguments: Any, tool_format: str = "hermes") -> str:
    """One call as the model writes it in ``tool_format`` (the parsers in server/tool_parsers
    read it back): Hermes wraps ``{"name", "arguments"}`` in <tool_call> tags, Llama 3 writes
    ``{"name", "parameters"}`` bare."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # shown as the string it is
    if tool_format == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


# An example argument of each JSON type: empty or zero, so that a model copying the example still
# writes a value of the right type, and none reads as an answer.
_EXAMPLE_VALUES: dict[str, Any] = {"string": "", "integer": 0, "number": 0, "boolean": False,
                                   "array": [], "object": {}, "null": None}


def example_arguments(schema: Any, depth: int = 0) -> Any:
    """A skeleton of arguments for a tool's ``parameters`` schema: its required properties (all of
    them when none is required), each with a value of its type (an enum's or const's first)."""
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    properties = schema.get("properties")
    if kind == "object" or (kind is None and isinstance(properties, dict)):
        if not isinstance(properties, dict) or depth > 2:
            return {}
        required = [k for k in schema.get("required") or [] if k in properties]
        return {key: example_arguments(properties[key], depth + 1) for key in required or properties}
    return _EXAMPLE_VALUES.get(kind, "") if isinstance(kind, str) else ""


def tools_system_block(tools: list[dict], tool_format: str = "hermes") -> str:
    """The tools described for a model whose chat template cannot render them (docs/server.md).

    The call syntax is shown with the first tool (its name, a skeleton of its arguments): a small
    model copies a placeholder such as ``<name>`` verbatim (docs/server.md, "Tool calling")."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    first = tools[0]["function"]
    arguments = example_arguments(first.get("parameters"))
    example = tool_call_text(first["name"], arguments if isinstance(arguments, dict) else {}, tool_format)
    return ("# Tools\n\nThese functions are available. Each is described by a JSON object inside "
            f"<tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, answer with "
            f"one line per call, in this form (here calling {first['name']}):\n{example}")


def _message_content(message: dict, tool_format: str) -> str:
    text = message_text(message.get("content"))
    calls = message.get("tool_calls") or []
    if message["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise ValueError("tool_calls must be a list")
        rendered = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("each tool call needs a function with a name")
            rendered.append(tool_call_text(function["name"], function.get("arguments", "{}"), tool_format))
        text = "\n".join(([text] if text else []) + rendered)
    if message["role"] == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return text


def normalize_chat_messages(messages: Any, tools: Any = None, tool_format: str = "hermes") -> list[dict[str, str]]:
    """The conversation handed to the chat template: each message's role and text.

    Takes the request's ``messages`` (and ``tools``) as JSON (the router passes the raw body, the
    server its validated messages dumped back to dicts), so both render the same text. Templates
    here render role and content only, so tool turns become text in ``tool_format``: an
    assistant's ``tool_calls`` follow its content as calls, a ``tool`` message is a
    <tool_response> in a user turn, and the tools are described in a system block (appended to the
    first system message, or a system message of their own). Names and call ids are not shown.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}")
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ValueError(f"each message needs a role, one of {', '.join(CHAT_ROLES)}")
        role = "user" if message["role"] == "tool" else message["role"]
        conversation.append({"role": role, "content": _message_content(message, tool_format)})
    defs = tool_definitions(tools)
    if defs:
        block = tools_system_block(defs, tool_format)
        if conversation[0]["role"] == "system":
            first = conversation[0]["content"]
            conversation[0] = {"role": "system", "content": f"{first}\n\n{block}" if first else block}
        else:
            conversation.insert(0, {"role": "system", "content": block})
    return conversation


def render_chat_prompt(tokenizer: Any, messages: list[dict], tools: Any = None, tool_format: str = "hermes") -> str:
    """The chat template applied to ``messages`` (normalised first, with ``tools``), ending with
    the assistant turn's opening."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    conversation = normalize_chat_messages(messages, tools, tool_format)
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def chat_prompt_token_ids(tokenizer: Any, messages: list[dict], tools: Any = None,
                          tool_format: str = "hermes") -> list[int]:
    """Token ids of a /v1/chat/completions prompt, from the request's ``messages`` (and
    ``tools``) as JSON."""
    return chat_text_token_ids(tokenizer, render_chat_prompt(tokenizer, messages, tools, tool_format))


def chat_text_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat-template text (or a piece of it, cut after a special token).

    The text already holds every special token, so it is encoded without adding more (a second
    BOS would shift every block hash).
    """
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
