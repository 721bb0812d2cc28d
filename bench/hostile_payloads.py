"""The request bodies of `bench/soak.py --hostile`'s newer kinds, built from the limits
`kvscale serve` enforces (kvscale/request_limits.py), so a change of a default moves the attack
with it: a request-wide bomb just within every limit, one request just over each limit, and
grammars that are slow to compile but small enough to be let in.

Pure functions: tests/bench/test_hostile_payloads.py runs each body through the server's own
checks.
"""

from __future__ import annotations

import json
from typing import Any

from bench.structured_outputs_serving import hard_schema
from kvscale.request_limits import FieldLimits, flag

MODEL = "smollm2-135m-instruct"
DEFAULTS = FieldLimits()  # `kvscale serve`'s, which the soak's replicas run with
# 250 alternatives of 30 bounded integers: ~1.5 s of one core's CPU time for llguidance on the
# bundled tokenizer on the host they were sized on (less on a faster one: bench/soak.py's
# --compile-timeout-s sits well under it), ~430 KB as compact JSON (under the 512 KiB a constraint may have). More
# branches make the library refuse the grammar as too big, which would test its size check, not
# the compile limits.
SLOW_SCHEMA_BRANCHES = 250
# Offsets above this lengthen the schema's numbers past the constraint's byte limit.
SLOW_SCHEMA_OFFSETS = 99_999
_MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def compact(value: Any) -> str:
    """JSON as `kvscale serve` measures a constraint (request_json.dumps_compact)."""
    return json.dumps(value, separators=(",", ":"))


def bomb_body(sequences: int, limits: FieldLimits = DEFAULTS) -> dict[str, Any]:
    """One completion request that asks the most of every request-wide field at once:
    ``sequences`` prompts sharing a full logit_bias and a full list of stop strings, one token
    each (the cost under test is the fields copied per sequence, not decoding)."""
    if not 1 <= sequences <= limits.max_sequences_per_request:
        raise ValueError(f"sequences must be within 1..{limits.max_sequences_per_request}, got {sequences}")
    # Small negative biases on the first token ids: valid for any vocabulary, barely felt.
    return {"model": MODEL, "prompt": [f"bomb {i}:" for i in range(sequences)], "max_tokens": 1,
            "logit_bias": {str(token): -1 for token in range(limits.max_logit_bias)},
            "stop": [f"<stop {i}>" for i in range(limits.max_stop_strings)]}


# What a bomb may be answered besides 200 with every choice: a limit's 400 (the message names
# its flag), a busy replica's or router's 503 (queue full, no room within --max-queue-wait) or
# the replica's 504 (not ready within --request-timeout), the ends docs/server.md and
# docs/router.md document. Anything else, or nothing within the client's deadline, is a miss.
BOMB_REFUSALS = frozenset({400, 503, 504})


def bomb_outcome(status: int | None, answer: bytes, seconds: float, sequences: int,
                 deadline_s: float) -> dict[str, Any]:
    """One bomb's outcome for the soak's report. ``status`` None: no answer within
    ``deadline_s`` (the client gave up). ``outcome``: ``answered`` (200 with one choice per
    sequence), ``refused`` (a documented refusal), ``deadline_exceeded``, ``wrong_answer`` (a
    200 missing choices, or any other status; 0: the connection closed without one)."""
    choices = None
    if status == 200:
        try:
            choices = len(json.loads(answer)["choices"])
        except (ValueError, KeyError, TypeError):
            choices = None
    if status is None:
        outcome = "deadline_exceeded"
    elif status == 200 and choices == sequences:
        outcome = "answered"
    elif status in BOMB_REFUSALS:
        outcome = "refused"
    else:
        outcome = "wrong_answer"
    return {"status": status, "seconds": round(seconds, 1), "choices": choices,
            "within_deadline": status is not None and seconds <= deadline_s, "outcome": outcome}


def _tool(index: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"tool_{index}", "description": "does nothing",
                                             "parameters": {"type": "object", "properties": {}}}}


def _oversized_schema(limits: FieldLimits) -> dict[str, Any]:
    # Many small properties, not one long string: an annotation could be dropped before the
    # size is taken, a property cannot.
    count = limits.max_structured_output_bytes // 16
    return {"type": "object", "properties": {f"p{i:06d}": {"type": "integer"} for i in range(count)}}


def over_limit_requests(limits: FieldLimits = DEFAULTS) -> dict[str, tuple[str, dict[str, Any], str]]:
    """Per kind: the path, a body over exactly one limit by one (the schema: by its bytes), and
    the flag its 400 must name."""
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    chat = {"model": MODEL, "messages": _MESSAGES, "max_tokens": 1}
    over = {name: getattr(limits, name) + 1 for name in ("max_logit_bias", "max_stop_strings",
                                                           "max_stop_token_ids", "max_tools")}
    return {
        "over_logit_bias": ("/v1/completions", {**completion, "logit_bias": {
            str(token): -1 for token in range(over["max_logit_bias"])}}, flag("max_logit_bias")),
        "over_stop": ("/v1/completions", {**completion, "stop": [
            f"<stop {i}>" for i in range(over["max_stop_strings"])]}, flag("max_stop_strings")),
        "over_stop_token_ids": ("/v1/completions", {**completion, "stop_token_ids": list(
            range(over["max_stop_token_ids"]))}, flag("max_stop_token_ids")),
        "over_tools": ("/v1/chat/completions", {**chat, "tools": [
            _tool(i) for i in range(over["max_tools"])]}, flag("max_tools")),
        "over_schema_bytes": ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "huge", "schema": _oversized_schema(limits)}}},
            flag("max_structured_output_bytes")),
    }


def slow_schema(index: int) -> dict[str, Any]:
    """The ``index``-th of distinct slow schemas: distinct, so no compile is served from the
    server's grammar cache."""
    return hard_schema(1 + index % SLOW_SCHEMA_OFFSETS, SLOW_SCHEMA_BRANCHES)


def slow_schema_body(index: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": _MESSAGES, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": f"slow_{index}", "schema": slow_schema(index)}}}


def names_limit(body: bytes, expected_flag: str) -> bool:
    """Whether an answer is the OpenAI error JSON whose message names ``expected_flag``."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(message, str) and expected_flag in message
