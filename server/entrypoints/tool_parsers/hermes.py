"""Hermes / Qwen 2.5 calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

from kvscale.server.entrypoints.tool_parsers.base import ToolCallFormat

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesFormat(ToolCallFormat):
    name = "hermes"
    args_key = "arguments"
    open_tag = OPEN + "\n"
    close_tag = "\n" + CLOSE
    trigger = OPEN

    def find_calls(self, text: str) -> tuple[str, list[tuple[int, int, bool]]]:
        first = text.find(OPEN)
        if first < 0:
            return text, []
        spans = []
        at = first
        while at >= 0:
            start = at + len(OPEN)
            end = text.find(CLOSE, start)
            spans.append((start, len(text) if end < 0 else end, end >= 0))
            at = -1 if end < 0 else text.find(OPEN, end + len(CLOSE))
        return text[:first], spans

    def may_start_call(self, text: str) -> int:
        for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
