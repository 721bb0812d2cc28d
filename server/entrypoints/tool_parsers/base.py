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
    # The start of ``open_tag`` that marks a call in free text (auto tool choice): once it is
    # written, the rest of the call is constrained. Empty: calls can only start the answer.
    trigger = ""

    # --- grammars that force calls (named and required tool choice) or constrain them (auto) --
    def call_rule(self, tool: dict[str, Any], *, after_trigger: bool = False) -> str:
        """Lark for one call of ``tool`` (its name fixed, its arguments its parameters schema);
        ``after_trigger``: what follows the trigger, once free text has written it."""
        schema = dict(tool.get("parameters") or {"type": "object"})
        schema["x-guidance"] = {"whitespace_pattern": ARGS_WHITESPACE}
        head = self.open_tag + "{" + json.dumps("name") + ": " + json.dumps(tool["name"]) + ", " + \
            json.dumps(self.args_key) + ": "
        if after_trigger:
            head = head[len(self.trigger):]
        return f"{json.dumps(head)} %json {json.dumps(schema)} {json.dumps('}' + self.close_tag)}"

    def _call_rules(self, tools: list[dict[str, Any]]) -> list[str]:
        rules = [f"call_{i}: {self.call_rule(tool)}" for i, tool in enumerate(tools)]
        choice = " | ".join(f"call_{i}" for i in range(len(tools)))
        return [f"call: {choice}", *rules]

    def grammar(self, tools: list[dict[str, Any]], *, many: bool) -> str:
        """Lark for one call of any of ``tools`` (or, with ``many``, one or more, a newline
        between): ``parallel_tool_calls: false`` is enforced here, not by dropping calls."""
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return "\n".join([start, *self._call_rules(tools)])

    def auto_grammar(self, tools: list[dict[str, Any]], *, many: bool) -> str:
        """Lark for an ``auto`` answer: free text, or text up to a call followed by calls only.

        Free text is anything until the format's trigger; from there on the answer is a call of
        one of ``tools`` (its arguments its parameters schema), then, with ``many``, further
        calls a newline apart, then the end. As xgrammar's structural tags do in vLLM and
        SGLang, the trigger is a lazy lexeme: it ends the text the moment it is written, so text
        cannot run on past a call's opening unconstrained.
        """
        more = ' ("\\n" call)*' if many else ""
        if self.trigger:
            # The lexer ends text_then_trigger at the first trigger (lazy), so the first
            # alternative, TEXT alone, only ever holds text without one.
            opened = [f"opened_{i}: {self.call_rule(tool, after_trigger=True)}" for i, tool in enumerate(tools)]
            return "\n".join([
                "%llguidance {}",
                f"start: TEXT | text_then_trigger opened{more}",
                f"text_then_trigger[lazy]: TEXT {json.dumps(self.trigger)}",
                "TEXT: /(.|\\n)*/",
                f"call: {json.dumps(self.trigger)} opened",
                "opened: " + " | ".join(f"opened_{i}" for i in range(len(tools))),
                *opened])
        # No trigger (Llama 3 JSON): an answer whose first non-space is "{" is calls, any other
        # answer is text (the parser reads them so: find_calls).
        return "\n".join([
            "%llguidance {}",
            f"start: TEXT | LEAD call{more}",
            "TEXT: /[ \\t\\n]*([^ \\t\\n{](.|\\n)*)?/",
            "LEAD: /[ \\t\\n]*/",
            *self._call_rules(tools)])

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
