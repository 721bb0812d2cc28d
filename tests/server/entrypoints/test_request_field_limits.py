"""What one request's fields may ask of the server (docs/server.md "Request limits"): each limit a
400 naming it and its flag, checked before the field is parsed; a request's prompts share its
request-wide fields; unknown field names are remembered in a bounded set. Pure, no engine."""

from __future__ import annotations

import logging

import pytest

from kvscale import request_limits
from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.request_limits import FieldLimits
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints import serving
from kvscale.server.entrypoints.serving import APIError, OpenAIServer
from kvscale.server.entrypoints.serving_chat import prepare_chat
from kvscale.server.entrypoints.serving_completions import prepare_completion

LIMITS = FieldLimits(max_sequences_per_request=8, max_stop_strings=2, max_stop_string_length=5,
                     max_stop_token_ids=3, max_logit_bias=4, max_structured_output_bytes=100, max_tools=2)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> OpenAIServer:
    return OpenAIServer(None, tokenizer=load_tokenizer(resolve_model_path(None)),  # type: ignore[arg-type]
                        served_model_names=["m"], max_model_len=64, field_limits=LIMITS)


OVER = {  # completion body fields -> (param, flag)
    "prompts x n": ({"prompt": ["a", "b", "c"], "n": 3}, "prompt", "--max-sequences-per-request"),
    "n alone": ({"n": 9}, "n", "--max-sequences-per-request"),
    "stop strings": ({"stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    "stop length": ({"stop": "abcdef"}, "stop", "--max-stop-string-length"),
    "stop ids": ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "--max-stop-token-ids"),
    "logit_bias": ({"logit_bias": {str(t): 1 for t in range(5)}}, "logit_bias", "--max-logit-bias"),
    "schema": ({"structured_outputs": {"json": {"type": "object", "description": "x" * 100}}},
               "structured_outputs", "--max-structured-output-bytes"),
    "choices": ({"structured_outputs": {"choice": ["y" * 60, "z" * 60]}}, "structured_outputs",
                "--max-structured-output-bytes"),
}


@pytest.mark.parametrize("case", sorted(OVER))
def test_each_limit_is_a_400_naming_it_and_its_flag(server: OpenAIServer, case: str) -> None:
    fields, param, flag = OVER[case]
    with pytest.raises(APIError) as info:
        prepare_completion(server, p.CompletionRequest(**{"prompt": "hi", "max_tokens": 2, **fields}))
    error = info.value
    assert error.status == 400 and error.param == param and f"({flag})" in error.message
    assert error.response().body  # the OpenAI error JSON


def test_at_the_limits_a_request_is_taken(server: OpenAIServer) -> None:
    prepared = prepare_completion(server, p.CompletionRequest(
        prompt=["a", "b"], n=4, max_tokens=2, stop=["ab", "abcde"], stop_token_ids=[1, 2, 3],
        logit_bias={str(t): 1 for t in range(4)}))
    assert len(prepared.params) == 2


def test_chat_tools_and_their_grammar_are_bounded(server: OpenAIServer) -> None:
    with pytest.raises(APIError) as info:
        prepare_chat(server, p.ChatCompletionRequest(messages=MESSAGES, tools=[TOOL] * 3, tool_choice="required"))
    assert info.value.param == "tools" and "(--max-tools)" in info.value.message
    with pytest.raises(APIError) as info:  # two tools fit the count; their grammar is over 100 bytes
        prepare_chat(server, p.ChatCompletionRequest(messages=MESSAGES, tools=[TOOL] * 2, tool_choice="required"))
    assert info.value.param == "tools" and "(--max-structured-output-bytes)" in info.value.message


def test_a_requests_prompts_share_its_request_wide_fields(server: OpenAIServer) -> None:
    """Built and validated once, not copied per prompt (engine_core_wire.py sends them once)."""
    prepared = prepare_completion(server, p.CompletionRequest(
        prompt=["a", "a b c"], max_tokens=None, stop=["x"], stop_token_ids=[5],
        logit_bias={"7": 2}, structured_outputs={"regex": "[ab]+"}))
    first, second = prepared.params
    assert first.max_tokens != second.max_tokens  # each prompt's own room in the context
    for name in ("stop", "stop_token_ids", "logit_bias", "structured_outputs"):
        assert getattr(first, name) is getattr(second, name), name


def test_unknown_field_names_are_remembered_in_a_bounded_set(server: OpenAIServer, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=serving.__name__)
    for i in range(3 * serving.UNKNOWN_FIELDS_KEPT):
        server.note_unknown_fields(p.CompletionRequest(prompt="x", **{f"field_{i}": 1}), "/v1/completions")
    assert len(server.unknown_fields_seen) == serving.UNKNOWN_FIELDS_KEPT
    assert "field_0" not in server.unknown_fields_seen
    assert len(caplog.records) == 1  # rate-limited, not one line per name


def test_serve_flags_set_every_limit_and_the_queue_is_bounded() -> None:
    from kvscale.cli import build_parser

    args = build_parser("serve").parse_args(["serve"])
    assert request_limits.field_limits_from_args(args) == FieldLimits()
    assert args.max_queue_len == request_limits.DEFAULT_MAX_QUEUE_LEN >= FieldLimits().max_sequences_per_request
    args = build_parser("serve").parse_args(["serve", "--max-logit-bias", "9", "--max-tools", "3",
                                             "--max-stop-strings", "4", "--max-stop-string-length", "5",
                                             "--max-stop-token-ids", "6", "--max-sequences-per-request", "7",
                                             "--max-structured-output-bytes", "8"])
    assert request_limits.field_limits_from_args(args) == FieldLimits(7, 4, 5, 6, 9, 8, 3)
    args = build_parser("serve").parse_args(["serve", "--max-logit-bias", "0"])
    with pytest.raises(SystemExit, match="--max-logit-bias"):
        request_limits.field_limits_from_args(args)


def test_the_key_is_compared_as_bytes_and_probes_stay_open() -> None:
    server = OpenAIServer(None, tokenizer=None, served_model_names=["m"], max_model_len=8,  # type: ignore[arg-type]
                          api_key="sk-é", vocab_size=8)
    assert server.is_authorized("/v1/models", "GET", "Bearer sk-é".encode())
    assert server.is_authorized("/v1/models", "GET", "bearer sk-é".encode())
    for wrong in (b"", b"Bearer sk-", "Basic sk-é".encode(), b"Bearer " + b"x" * 10_000):
        assert not server.is_authorized("/v1/models", "GET", wrong)
    assert server.is_authorized("/health", "GET", b"") and server.is_authorized("/metrics", "GET", b"")
    assert not server.is_authorized("/openapi.json", "GET", b"")
    assert not server.is_authorized("/docs", "GET", b"")
