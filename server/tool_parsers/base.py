"""What every tool-call format provides, and the parsing they share.

A call is ``OPEN {"name": "<name>", "<args key>": <arguments JSON>} CLOSE`` (OPEN/CLOSE: tags,
or nothing). The arguments a client receives are the raw JSON text the model wrote for them,
stripped of surrounding whitespace; a streamed call sends that same text in pieces, each piece
ending before the last ``}`` seen so far (which might still close the call rather than the
arguments), so the pieces always add up to exactly the non-streamed arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Between JSON tokens inside a forced call: the same bound as structured outputs (backend.py).
ARGS_WHITESPACE = r"(\n {0,16}| )"


@dataclass
class ParsedCall:
    name: str | None  # None until the whole name has been written
    arguments: str  # the arguments' JSON text so far (all of it once complete)
    complete: bool


class ToolCallFormat:
    name = ""
    args_key = "arguments"
    open_tag = ""  # text that opens a call
    close_tag = ""  # text that closes it

    # --- grammars that force calls (named and required tool choice) ----------------------------
    def call_rule(self, tool: dict[str, Any]) -> str:
        """Lark for one call of ``tool`` (its name fixed, its arguments its parameters schema)."""
        schema = dict(tool.get("parameters") or {"type": "object"})
        schema["x-guidance"] = {"whitespace_pattern": ARGS_WHITESPACE}
        head = self.open_tag + "{" + json.dumps("name") + ": " + json.dumps(tool["name"]) + ", " + \
            json.dumps(self.args_key) + ": "
        return f"{json.dumps(head)} %json {json.dumps(schema)} {json.dumps('}' + self.close_tag)}"

    def grammar(self, tools: list[dict[str, Any]], *, many: bool) -> str:
        """Lark for one call of any of ``tools`` (or, with ``many``, one or more, a newline
        between): ``parallel_tool_calls: false`` is enforced here, not by dropping calls."""
        rules = [f"call_{i}: {self.call_rule(tool)}" for i, tool in enumerate(tools)]
        choice = " | ".join(f"call_{i}" for i in range(len(tools)))
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return "\n".join([start, f"call: {choice}", *rules])

    # --- parsing ------------------------------------------------------------------------------
    def find_calls(self, text: str) -> tuple[str, list[tuple[int, int, bool]]]:
        """The content before the first call, and each call's (start, end, closed) span of its
        body (the ``{...`` after OPEN; end = len(text) for a call still being written)."""
        raise NotImplementedError

    def may_start_call(self, text: str) -> int:
        """How much of ``text`` is surely content: the rest might open a call (held back while
        streaming)."""
        raise NotImplementedError

    def parse(self, text: str, *, final: bool) -> tuple[str, list[ParsedCall]]:
        """Content and calls in ``text`` (a partial answer unless ``final``). Raises ValueError
        for a finished call that is not a call (bad JSON, no name)."""
        content, spans = self.find_calls(text)
        calls = []
        for start, end, closed in spans:
            calls.append(_parse_body(text[start:end], self.args_key, complete=closed or final))
        return content, calls


_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?P<key>[a-z]+)"\s*:\s*')


def _parse_body(body: str, args_key: str, *, complete: bool) -> ParsedCall:
    match = _NAME.match(body)
    if match is None or match.group("key") != args_key:
        if complete:
            raise ValueError(f"not a tool call: {body[:80]!r}")
        return ParsedCall(None, "", False)
    name = json.loads(match.group(1))
    rest = body[match.end():]
    if complete:
        end = rest.rstrip().rfind("}")
        if end < 0:
            raise ValueError(f"tool call {name!r} is not closed")
        arguments = rest[:end].strip()
        json.loads(arguments)  # raises ValueError for arguments that are not JSON
        return ParsedCall(name, arguments, True)
    cut = rest.rfind("}")
    return ParsedCall(name, rest[:cut].strip() if cut >= 0 else "", False)
