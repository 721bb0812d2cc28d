"""Llama 3.x JSON calls: the answer is ``{"name": ..., "parameters": {...}}`` (several separated
by ``;`` or newlines), with no tags around it."""

from __future__ import annotations

from kvscale.server.entrypoints.tool_parsers.base import ToolCallFormat


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    args_key = "parameters"

    def find_calls(self, text: str) -> tuple[str, list[tuple[int, int, bool]]]:
        # An answer is calls only when it starts with an object naming a function.
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return text, []
        offset = len(text) - len(stripped)
        spans = []
        depth, start, in_string, escaped = 0, None, False, False
        for i, ch in enumerate(stripped):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                continue
            if ch == '"':
                in_string = True
            elif ch == "{":
                if depth == 0:
                    start = i
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0 and start is not None:
                    spans.append((offset + start, offset + i + 1, True))
                    start = None
        if start is not None:
            spans.append((offset + start, len(text), False))
        return "", spans

    def may_start_call(self, text: str) -> int:
        # Calls start the answer: until a non-space, non-brace character, nothing is surely content.
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)
