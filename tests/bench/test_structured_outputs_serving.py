"""The tool-call judge of bench/structured_outputs_serving.py: what counts as a valid call, a
violation, a cut or a text answer."""

from __future__ import annotations

from bench.structured_outputs_serving import hard_schema, judge_calls

TOOL = {"type": "function", "function": {"name": "area", "parameters": {
    "type": "object", "properties": {"side": {"type": "integer"}}, "required": ["side"],
    "additionalProperties": False}}}


def call(arguments: str, name: str = "area") -> dict:
    return {"name": name, "arguments": arguments}


def test_valid_calls() -> None:
    assert judge_calls("named", TOOL, "tool_calls", [call('{"side": 3}')])["outcome"] == "valid"
    assert judge_calls("required", TOOL, "tool_calls", [call('{"side": 3}'), call('{"side": 4}')])["outcome"] == "valid"


def test_violations() -> None:
    assert judge_calls("required", TOOL, "tool_calls", [call('{"side": "3"}')])["outcome"] == "violation"
    assert judge_calls("required", TOOL, "tool_calls", [call('{"side": 3')])["outcome"] == "violation"
    assert judge_calls("auto", TOOL, "tool_calls", [call('{"side": 3}', name="volume")])["outcome"] == "violation"
    # named and non-parallel modes allow exactly one call
    two = [call('{"side": 3}'), call('{"side": 4}')]
    assert judge_calls("single", TOOL, "tool_calls", two)["outcome"] == "violation"
    assert judge_calls("named", TOOL, "stop", two)["outcome"] == "violation"


def test_a_cut_answer_is_a_cut_and_no_call_is_text() -> None:
    assert judge_calls("required", TOOL, "length", [call('{"side": ')])["outcome"] == "length"
    assert judge_calls("auto", TOOL, "stop", [])["outcome"] == "text"


def test_hard_schemas_differ_by_offset() -> None:
    assert hard_schema(1, 3) != hard_schema(2, 3)
    assert len(hard_schema(1, 3)["anyOf"]) == 3
