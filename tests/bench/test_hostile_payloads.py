"""The hostile soak's payloads (bench.hostile_payloads) against `kvscale serve`'s own checks
(kvscale.request_limits): the bomb within every limit, each over-limit request over exactly the
limit it names, the slow schemas small enough to be let in and distinct; and the soak's verdict
on its report (bench.soak_report.hostile_targets_met)."""

from __future__ import annotations

import json
import re

import pytest

from bench.hostile_payloads import (
    SLOW_SCHEMA_OFFSETS,
    bomb_body,
    bomb_outcome,
    compact,
    names_limit,
    over_limit_requests,
    slow_schema,
    slow_schema_body,
)
from bench.soak_report import bombs_bounded, hostile_targets_met
from kvscale.request_limits import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    FieldLimits,
    LimitExceeded,
    check_sampling_fields,
    check_sequences,
    check_structured_bytes,
)

LIMITS = FieldLimits()


def _check(body: dict) -> None:
    """What the server checks of a body before parsing its fields (serving.check_field_limits,
    check_constraint_size)."""
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    check_sequences(LIMITS, prompts, body.get("n", 1))
    stop = body.get("stop") or []
    check_sampling_fields(LIMITS, stop=[stop] if isinstance(stop, str) else stop,
                          stop_token_ids=len(body.get("stop_token_ids") or ()),
                          logit_bias=len(body.get("logit_bias") or {}), tools=len(body.get("tools") or ()))
    response_format = body.get("response_format")
    if response_format:
        check_structured_bytes(LIMITS, len(compact(response_format["json_schema"]["schema"]).encode()),
                               "response_format")


def test_the_full_bomb_is_at_every_request_wide_limit_and_within_it() -> None:
    body = bomb_body(DEFAULT_MAX_SEQUENCES_PER_REQUEST)
    _check(body)
    assert len(body["prompt"]) == LIMITS.max_sequences_per_request
    assert len(body["logit_bias"]) == LIMITS.max_logit_bias
    assert len(body["stop"]) == LIMITS.max_stop_strings
    assert max(map(len, body["stop"])) <= LIMITS.max_stop_string_length
    assert len(set(body["stop"])) == len(body["stop"])


def test_a_bomb_over_the_sequence_limit_is_not_built() -> None:
    with pytest.raises(ValueError):
        bomb_body(DEFAULT_MAX_SEQUENCES_PER_REQUEST + 1)
    with pytest.raises(ValueError):
        bomb_body(0)


@pytest.mark.parametrize("kind", list(over_limit_requests()))
def test_each_over_limit_request_breaks_only_the_limit_it_names(kind: str) -> None:
    path, body, expected_flag = over_limit_requests()[kind]
    assert path in ("/v1/completions", "/v1/chat/completions")
    with pytest.raises(LimitExceeded, match=re.escape(expected_flag)):
        _check(body)
    # One over: the same body at the limit passes (the schema: any other limit would have raised first).
    if kind != "over_schema_bytes":
        field = {"over_logit_bias": "logit_bias", "over_stop": "stop", "over_stop_token_ids": "stop_token_ids",
                 "over_tools": "tools"}[kind]
        trimmed = dict(body)
        trimmed[field] = (dict(list(body[field].items())[:-1]) if isinstance(body[field], dict)
                          else body[field][:-1])
        _check(trimmed)


def test_the_slow_schemas_are_let_in_and_each_is_distinct() -> None:
    for index in (0, 1, SLOW_SCHEMA_OFFSETS - 1, 10 * SLOW_SCHEMA_OFFSETS + 3):
        _check({"messages": [], **slow_schema_body(index)})
    texts = {compact(slow_schema(index)) for index in range(5)}
    assert len(texts) == 5
    assert len(slow_schema(0)["anyOf"]) == 250


def test_a_refusal_names_its_limit_only_in_the_openai_error_json() -> None:
    answer = json.dumps({"error": {"message": "This request has 65 stop strings; this server takes at most "
                                              "64 (--max-stop-strings).", "type": "invalid_request_error",
                                   "param": "stop", "code": None}}).encode()
    assert names_limit(answer, "--max-stop-strings")
    assert not names_limit(answer, "--max-tools")
    assert not names_limit(b"<html>bad gateway</html>", "--max-stop-strings")
    assert not names_limit(b'{"error": "--max-stop-strings"}', "--max-stop-strings")


def _answer(choices: int) -> bytes:
    return json.dumps({"choices": [{"index": i, "text": "x"} for i in range(choices)]}).encode()


def test_a_bomb_is_answered_only_with_every_choice_within_its_deadline() -> None:
    assert bomb_outcome(200, _answer(3), 12.0, 3, 300)["outcome"] == "answered"
    short = bomb_outcome(200, _answer(2), 12.0, 3, 300)
    assert short["outcome"] == "wrong_answer" and short["choices"] == 2
    assert bomb_outcome(200, b"<html>", 12.0, 3, 300)["outcome"] == "wrong_answer"
    late = bomb_outcome(200, _answer(3), 301.0, 3, 300)
    assert late["outcome"] == "answered" and late["within_deadline"] is False


def test_a_bomb_refused_as_documented_is_bounded_and_anything_else_is_not() -> None:
    refused = [bomb_outcome(status, b"{}", 1.0, 3, 300) for status in (400, 503, 504)]
    assert {o["outcome"] for o in refused} == {"refused"} and bombs_bounded(refused) is True
    for status in (0, 502, 500, 429):
        assert bombs_bounded([bomb_outcome(status, b"", 1.0, 3, 300)]) is False, status
    unanswered = bomb_outcome(None, b"", 300.0, 3, 300)
    assert unanswered["outcome"] == "deadline_exceeded" and unanswered["within_deadline"] is False
    assert bombs_bounded([bomb_outcome(200, _answer(3), 9.0, 3, 300), unanswered]) is False
    assert bombs_bounded([bomb_outcome(200, _answer(3), 301.0, 3, 300)]) is False
    assert bombs_bounded([]) is None


def _report(**hostile: dict) -> dict:
    over = {kind: {"refused_400": 3, "named_the_limit": 3} for kind in over_limit_requests()}
    statuses = {"bomb": {"200": 2}, "unauthenticated": {"401": 9}, "slow_schema": {"400": 4, "503": 1},
                **hostile.get("statuses", {})}
    sent = {kind: sum(counts.values()) for kind, counts in statuses.items()} | {kind: 3 for kind in over}
    return {"honest_alone": {"failed": 0}, "honest_beside_hostile": {"failed": 0}, "ttft_p90_ratio": 1.2,
            "leaked_blocks": {"r0": 0.0}, "processes_alive": {"r0": True, "router-a": True},
            "hostile": {"statuses": statuses, "sent": sent, "over_limit": over,
                        "unauthenticated_body_bytes_sent_max": hostile.get("unauth_bytes", 0),
                        "bombs": hostile.get("bombs", [bomb_outcome(200, _answer(4), 30.0, 4, 300)]),
                        "loop_errors": hostile.get("loop_errors", [])}}


def test_the_hostile_targets_are_read_from_the_report() -> None:
    assert all(hostile_targets_met(_report()).values())
    missed = hostile_targets_met(_report(statuses={"slow_schema": {"200": 1}}, unauth_bytes=2**20,
                                         bombs=[bomb_outcome(None, b"", 300.0, 4, 300)]))
    assert missed["bombs_end_within_deadline"] is False and missed["slow_schema_answers"] is False
    assert missed["unauthenticated_refused_before_body"] is False
    assert missed["honest_failed_0"] is True
    crashed = hostile_targets_met(_report(loop_errors=["bomb: ReadTimeout: "]))
    assert crashed["hostile_clients_ran_throughout"] is False
