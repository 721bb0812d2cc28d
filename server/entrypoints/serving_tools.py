"""Tool calling on /v1/chat/completions: the request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` to a constraint, and the answer's text back to ``tool_calls``, whole or
streamed.

``tool_choice`` named or ``required``: the answer is forced, by a grammar, to be calls in the
format's syntax with each tool's parameters schema (``parallel_tool_calls: false``: exactly one
call). ``auto``: the model writes free text until it opens a call (the format's trigger), and
from there on the grammar holds it to calls of the declared tools, the same call rules as forced
calls; the ``--tool-call-parser`` format finds the calls in the text (without
``--enable-auto-tool-choice`` that is a 400 saying so). ``none``: plain text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.tool_parsers import ToolCallFormat, tool_call_format
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.strict_schema import close_objects


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolPlan:
    """How a chat request handles tools: ``mode`` is "forced" (named or required), "auto", or
    None (no tool calls)."""

    mode: str | None
    fmt: ToolCallFormat
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None


def plan_tools(body: p.ChatCompletionRequest, *, parser: str | None, auto_enabled: bool) -> ToolPlan:
    """Raises ValueError(message, param) for a combination the server cannot honour."""
    fmt = tool_call_format(parser)
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    parallel = body.parallel_tool_calls is not False
    if not tools:
        if choice != "none":
            raise ToolError("tool_choice needs tools.", "tool_choice")
        return ToolPlan(None, fmt)
    if choice == "none":
        return ToolPlan(None, fmt)
    constrained_format = body.response_format is not None and body.response_format.type != "text"
    if constrained_format or body.structured_outputs is not None:
        raise ToolError("tool calls cannot be combined with response_format or structured_outputs; "
                        'set tool_choice to "none" for a constrained answer.', "tool_choice")
    if choice == "auto":
        if not (auto_enabled and parser):
            raise ToolError('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                            "--tool-call-parser (hermes or llama3_json); a named or \"required\" "
                            "tool_choice works without them.", "tool_choice")
    definitions = [strict_closed(tool.function.model_dump(exclude_none=True)) for tool in tools]
    if choice == "auto":
        grammar = fmt.auto_grammar([auto_enforced(d) for d in definitions], many=parallel)
        return ToolPlan("auto", fmt, parallel, StructuredOutputsParams(grammar=grammar))
    if choice == "required":
        chosen = definitions
    else:
        assert isinstance(choice, p.NamedToolChoice)
        chosen = [d for d in definitions if d["name"] == choice.function.name]
        if not chosen:
            raise ToolError(f"tool_choice names {choice.function.name!r}, which is not among the tools.",
                            "tool_choice")
        parallel = False  # a named choice is one call of that function
    grammar = fmt.grammar(chosen, many=parallel)
    return ToolPlan("forced", fmt, parallel, StructuredOutputsParams(grammar=grammar))


def strict_closed(definition: dict[str, Any]) -> dict[str, Any]:
    """A ``strict`` tool's parameters with the objects they leave open closed (strict_schema.py)."""
    parameters = definition.get("parameters")
    if not definition.get("strict") or not isinstance(parameters, dict):
        return definition
    return {**definition, "parameters": close_objects(parameters)}


def auto_enforced(definition: dict[str, Any]) -> dict[str, Any]:
    """The tool as ``auto`` constrains its calls: its parameters schema where the library enforces
    it exactly. A tool the model need not call must not turn a request into a 400, so a non-strict
    one the library refuses keeps its name but takes any JSON object as arguments; a strict one
    keeps its schema, and the compile's 400 names the keyword, as for a forced call."""
    parameters = definition.get("parameters")
    if definition.get("strict") or not parameters or backend.schema_refusal(parameters) is None:
        return definition
    return {**definition, "parameters": {"type": "object"}}


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def wire_call(index: int | None, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    item: dict[str, Any] = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if index is not None:
        item["index"] = index
    return item


def finished_message(plan: ToolPlan, text: str, finish_reason: str | None,
                     on_parse_failure: Any = None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a whole answer."""
    if plan.mode is None or finish_reason not in ("stop", None):
        return text, [], finish_reason
    try:
        content, calls = plan.fmt.parse(text, final=True)
    except ValueError:
        if on_parse_failure is not None:
            on_parse_failure()
        return text, [], finish_reason
    if not calls:
        return text, [], finish_reason
    tool_calls = [wire_call(None, tool_call_id(), call.name or "", call.arguments) for call in calls]
    return content or None, tool_calls, "tool_calls"


@dataclass
class ToolStream:
    """One streamed choice's tool calls: what of the text went out as content, and per call
    whether its id and name went out and how much of its arguments."""

    text: str = ""
    content_sent: int = 0
    in_calls: bool = False
    names_sent: int = 0
    args_sent: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    failed: bool = False

    def step(self, plan: ToolPlan, piece: str, finished: bool) -> tuple[str, list[dict]]:
        """Content and tool-call deltas for the text grown by ``piece``."""
        self.text += piece
        if self.failed:
            return self._content_up_to(len(self.text)), []
        try:
            content, calls = plan.fmt.parse(self.text, final=finished)
        except ValueError:
            self.failed = True
            return self._content_up_to(len(self.text)), []
        deltas: list[dict] = []
        if not calls:
            surely_content = len(self.text) if finished else plan.fmt.may_start_call(self.text)
            if plan.mode == "forced":
                surely_content = 0  # forced answers are calls only
            return self._content_up_to(surely_content), deltas
        text_out = "" if self.in_calls else self._content_up_to(len(content))
        self.in_calls = True
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index >= len(self.ids):
                self.ids.append(tool_call_id())
                self.args_sent.append(0)
                deltas.append(wire_call(index, self.ids[index], call.name, ""))
            new_args = call.arguments[self.args_sent[index]:]
            if new_args:
                self.args_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new_args}})
        return text_out, deltas

    def _content_up_to(self, end: int) -> str:
        if self.in_calls or end <= self.content_sent:
            return ""
        out = self.text[self.content_sent:end]
        self.content_sent = end
        return out
