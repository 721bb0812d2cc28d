"""Tool-call formats without a model: parsing whole and streamed answers of each format (the
pieces of a streamed call add up to exactly the non-streamed arguments), the grammars that force
calls (parallel_tool_calls: false admits one call only), and the prompt rendering of tools and
tool turns shared with the router."""

from __future__ import annotations

import json

import pytest

from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving_tools import (
    ToolError,
    ToolStream,
    finished_message,
    plan_tools,
)
from kvscale.server.entrypoints.tool_parsers import tool_call_format
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.tokenization import chat_prompt_token_ids, render_chat_prompt, tool_call_text

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "math.add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}

ANSWERS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "math.add", "arguments": {"a": 1, "b": {"x": "}"}}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa}ris", "days": 2}}; '
                   '{"name": "math.add", "parameters": {"a": 1, "b": {"x": "}\\""}}}',
}


def request(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, ADD], **fields)


@pytest.mark.parametrize("fmt_name", sorted(ANSWERS))
def test_streamed_calls_add_up_to_the_whole_answer_at_any_split(fmt_name):
    plan = plan_tools(request(tool_choice="auto"), parser=fmt_name, auto_enabled=True)
    text = ANSWERS[fmt_name]
    content, calls, finish = finished_message(plan, text, "stop")
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "math.add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Pa}ris", "days": 2}
    for step in (1, 3, 7, 1000):
        stream = ToolStream()
        sent_content, streamed = "", {}
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for k, piece in enumerate(pieces):
            out, deltas = stream.step(plan, piece, finished=k == len(pieces) - 1)
            sent_content += out
            for delta in deltas:
                entry = streamed.setdefault(delta["index"], {"name": None, "arguments": ""})
                if "id" in delta:
                    assert entry["name"] is None and delta["function"]["name"]  # id and name first
                    entry["name"] = delta["function"]["name"]
                entry["arguments"] += delta["function"]["arguments"]
        assert sent_content == (content or "")
        assert [(e["name"], e["arguments"]) for e in streamed.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_auto_without_a_parser_is_refused_naming_the_flags():
    with pytest.raises(ToolError, match="--enable-auto-tool-choice --tool-call-parser"):
        plan_tools(request(), parser=None, auto_enabled=False)
    with pytest.raises(ToolError, match="not among the tools"):
        plan_tools(request(tool_choice={"type": "function", "function": {"name": "nope"}}), parser=None,
                   auto_enabled=False)
    with pytest.raises(ToolError):
        plan_tools(p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="required"),
                   parser=None, auto_enabled=False)


@pytest.fixture(scope="module")
def admits(bundled_tokenizer):
    """admits(plan, text): whether the plan's grammar accepts ``text`` as a whole answer."""
    lltok = backend.build_tokenizer(bundled_tokenizer, 49152, {0, 2})

    def admits(plan, text: str) -> bool:
        compiled = backend.compile_grammar(lltok, backend.grammar_text(plan.constraint))
        matcher = backend.Matcher.of(compiled)
        ids = bundled_tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.consume(t) for t in ids) and matcher.is_accepting()

    return admits


@pytest.mark.parametrize("fmt_name", sorted(ANSWERS))
def test_forced_grammars_admit_valid_calls_only_and_one_call_without_parallel(fmt_name, admits):
    fmt = tool_call_format(fmt_name)
    one = tool_call_text("get_weather", {"city": "Rome"}, fmt_name)
    other = tool_call_text("math.add", {"a": 1, "b": 2}, fmt_name)
    bad_args = tool_call_text("get_weather", {"town": "Rome"}, fmt_name)
    required = plan_tools(request(tool_choice="required"), parser=fmt_name, auto_enabled=False)
    single = plan_tools(request(tool_choice="required", parallel_tool_calls=False), parser=fmt_name,
                        auto_enabled=False)
    named = plan_tools(request(tool_choice={"type": "function", "function": {"name": "math.add"}}),
                       parser=fmt_name, auto_enabled=False)
    assert isinstance(required.constraint, StructuredOutputsParams)
    assert admits(required, one) and admits(required, one + "\n" + other)
    assert admits(single, one) and not admits(single, one + "\n" + other)
    assert not admits(required, bad_args)
    assert admits(named, other) and not admits(named, one)
    assert fmt.parse(one, final=True)[1][0].name == "get_weather"



UNIQUE = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "required": ["tags"]}}}


@pytest.mark.parametrize("fmt_name", sorted(ANSWERS))
def test_auto_lets_text_through_and_constrains_an_opened_call_to_a_declared_tool(fmt_name, admits):
    auto = plan_tools(request(tool_choice="auto"), parser=fmt_name, auto_enabled=True)
    single = plan_tools(request(tool_choice="auto", parallel_tool_calls=False), parser=fmt_name, auto_enabled=True)
    one = tool_call_text("get_weather", {"city": "Rome"}, fmt_name)
    other = tool_call_text("math.add", {"a": 1, "b": 2}, fmt_name)
    # Free text, with or without a call's opening in its words, stays free.
    prose = "It is sunny in Rome {today} < > <tool_ca"
    assert admits(auto, prose) and admits(auto, "")
    # A call: its name one of the tools, its arguments valid; then another call (parallel) or the end.
    lead = "Let me check.\n" if fmt_name == "hermes" else ""
    assert admits(auto, lead + one) and admits(auto, one + "\n" + other)
    assert admits(single, one) and not admits(single, one + "\n" + other)
    assert not admits(auto, tool_call_text("<name>", {"<argument>": "<value>"}, fmt_name))
    assert not admits(auto, tool_call_text("get_weather", {"city": "Rome", "days": "10"}, fmt_name))
    assert not admits(auto, one + " and some text after it")


def test_auto_with_a_tool_the_library_cannot_enforce(admits):
    # Not strict: the request is served, that tool's arguments any JSON object, the others exact.
    body = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, UNIQUE])
    plan = plan_tools(body, parser="hermes", auto_enabled=True)
    assert admits(plan, tool_call_text("tag", {"tags": ["a", "a"], "other": 1}))
    assert not admits(plan, tool_call_text("tag", ["a"]))
    assert not admits(plan, tool_call_text("get_weather", {"town": "Rome"}))
    # Strict: enforced exactly or not at all; the compile refuses it naming the keyword (a 400).
    strict = {"type": "function", "function": {**UNIQUE["function"], "strict": True}}
    body = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, strict])
    with pytest.raises(backend.GrammarError, match="uniqueItems"):
        admits(plan_tools(body, parser="hermes", auto_enabled=True), "")

def test_tool_turns_reach_the_template_and_router_and_server_render_alike(bundled_tokenizer):
    from kvscale.router.chat_tokens import ChatTokenCache

    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    text = render_chat_prompt(bundled_tokenizer, messages, [WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and "<tools>" in text
    # The server renders its validated request; the router the raw JSON: the same ids.
    body = p.ChatCompletionRequest(messages=messages, tools=[WEATHER])
    server_json = [m.model_dump(exclude_none=True) for m in body.messages]
    tools_json = [t.model_dump(exclude_none=True) for t in body.tools or []]
    server_ids = chat_prompt_token_ids(bundled_tokenizer, server_json, tools_json)
    cache = ChatTokenCache(bundled_tokenizer)
    for _ in range(2):  # a miss, then a hit on the cached history
        assert cache.prompt(messages, 16, None, [WEATHER])[0] == server_ids
