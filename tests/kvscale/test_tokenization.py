"""The tools system block of kvscale/tokenization.py (shared by the server and the router): it
shows the call syntax with a real tool of the request, never a placeholder a model could copy."""

from __future__ import annotations

import pytest

from kvscale.tokenization import tool_call_text, tool_definitions, tools_system_block

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize("tool_format", ["hermes", "llama3_json"])
def test_the_example_call_is_a_real_tool_with_arguments_of_its_schema(tool_format):
    block = tools_system_block(tool_definitions([WEATHER, NO_PARAMS]), tool_format)
    assert "<name>" not in block and "<argument>" not in block and "<value>" not in block
    # The first tool, its required arguments with a value of each one's type.
    assert tool_call_text("get_weather", {"city": "", "days": 0}, tool_format) in block


def test_a_tool_without_parameters_is_shown_with_empty_arguments():
    block = tools_system_block(tool_definitions([NO_PARAMS]))
    assert tool_call_text("now", {}) in block
