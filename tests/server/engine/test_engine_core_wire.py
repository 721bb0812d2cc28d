"""The front end <-> engine core messages: the engine's dataclasses cross the wire whole, and a
field another part adds to one of them crosses with no change to the wire code."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from kvscale.server.engine.engine_core_wire import (
    Accepted,
    AddRequests,
    NewRequestMsg,
    StepDone,
    core_codec,
    front_codec,
)
from kvscale.server.outputs import (
    CompletionOutput,
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from kvscale.server.sampling_params import SamplingParams


def stats() -> EngineStats:
    return EngineStats(1, 2, 64, 3, 4, 16, 100, 50, 0, extra={"last_step_s": 0.01})


def test_outputs_and_stats_round_trip() -> None:
    output = RequestOutput(
        "r", None, [1, 2, 3],
        [CompletionOutput(0, " hi", [7], "stop", 7, [{7: Logprob(-0.5, 1, " hi"), 9: Logprob(-2.0, 2, "x")}])],
        True, num_cached_tokens=16, metrics=RequestMetrics(1.0, 1.5, 2.0, 2.0, 2.0),
        prompt_logprobs=[None, {2: Logprob(-1.0, 1, "b")}])
    data = core_codec().encode(StepDone([output], stats()))
    decoded = front_codec().decode(data)
    assert decoded == StepDone([output], stats())
    assert isinstance(decoded.outputs[0].outputs[0].logprobs[0][7], Logprob)


def test_requests_round_trip_with_params_validated_again() -> None:
    params = SamplingParams(n=2, temperature=0.5, stop=["\n"], logprobs=3, max_tokens=9, seed=4)
    message = AddRequests(5, [NewRequestMsg("a", [1, 2], params, "salt"), NewRequestMsg("b", "text", params)],
                          tenant="team-a", priority=-3)
    assert core_codec().decode(front_codec().encode(message)) == message
    refusal = Accepted(5, "invalid", "max_tokens must be at least 1")
    assert front_codec().decode(core_codec().encode(refusal)) == refusal


@dataclass
class Grammar:
    kind: str
    spec: str


@dataclass
class ParamsWithMore(SamplingParams):
    """What another part adding a nested field to SamplingParams looks like."""

    structured: Grammar | None = None
    tags: list[str] = field(default_factory=list)


def test_a_new_nested_field_crosses_without_wire_changes() -> None:
    params = ParamsWithMore(temperature=0.0, structured=Grammar("json", "{}"), tags=["x"])
    data = msgspec.msgpack.encode(NewRequestMsg("a", [1], params))

    class Message(msgspec.Struct, array_like=True):
        request_id: str
        prompt: str | list[int]
        params: ParamsWithMore
        cache_salt: str | None = None

    decoded = msgspec.msgpack.decode(data, type=Message)
    assert decoded.params == params and decoded.params.structured == Grammar("json", "{}")


def test_request_wide_fields_cross_once_per_request() -> None:
    """A request of many prompts with a large logit_bias: the bias is on the wire once, and the
    core's prompts hold one dict between them (docs/server.md "Request limits")."""
    bias = {token: 1.0 for token in range(5000)}
    first = SamplingParams(max_tokens=4, stop=["\n"], stop_token_ids=[7], logit_bias=bias)
    prompts = [first] + [first.with_max_tokens(3 + i) for i in range(63)]
    message = AddRequests(1, [NewRequestMsg(f"r-{i}", [1, 2], params) for i, params in enumerate(prompts)],
                          tenant="team-a")
    one = len(front_codec().encode(AddRequests(1, message.requests[:1])))
    data = front_codec().encode(message)
    assert len(data) < one + 64 * 500  # the params of one prompt, not 64 copies of the bias (~60 KB)
    decoded = core_codec().decode(data)
    assert decoded == message and decoded.tenant == "team-a"
    assert all(r.params.logit_bias is decoded.requests[0].params.logit_bias for r in decoded.requests)
    assert [r.params.max_tokens for r in decoded.requests] == [4, *range(3, 66)]
    assert first.logit_bias is bias and first.stop == ["\n"]  # the caller's params untouched


def test_shared_fields_are_validated_on_arrival() -> None:
    params = SamplingParams(logit_bias={1: 1.0})
    params.logit_bias = {1: 500.0}  # what a front end that skipped its checks might send
    data = front_codec().encode(AddRequests(1, [NewRequestMsg("a", [1], params)]))
    with pytest.raises(ValueError, match="logit_bias"):
        core_codec().decode(data)
