"""OpenAI's Responses API end to end: a real `kvscale serve` process, the bundled model, and the
official `openai` client's `responses` resource (create, retrieve, delete, streams). Few and short
generations: the refusals generate nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
from openai.types.responses import Response, ResponseTextDeltaEvent, ResponseTextDoneEvent
from openai.types.responses.response_output_text import Logprob, LogprobTopLogprob

from kvscale.server.entrypoints.protocol_responses import ResponsesRequest
from kvscale.server.entrypoints.responses_output import ResponseHead
from kvscale.server.entrypoints.responses_stream import ResponseEvents

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess, scrape  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
LOGPROBS = "message.output_text.logprobs"


@pytest.fixture(scope="module")
def server():
    # float32 whatever the CPU: the default dtype is bfloat16 where the CPU multiplies bf16 in
    # hardware (AVX-512 BF16, AMX), and there a prefix-cache hit computes a prompt's last tokens on
    # other kernel shapes than a whole prompt, which moves a bf16 logit by an ulp (0.05 nats);
    # the logprob test compares a streamed request's numbers with an identical earlier one's.
    proc = ServeProcess("--max-model-len", "1024", "--num-gpu-blocks-override", "128", "--dtype", "float32",
                        "--served-model-name", "smollm2", log_name="responses")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_conversation_continued_retrieved_and_deleted(client, server) -> None:
    first = client.responses.create(model="smollm2", input="Name a colour.", instructions="Answer in one word.",
                                    max_output_tokens=4, temperature=0, metadata={"case": "chain"})
    assert first.object == "response" and first.id.startswith("resp_") and first.model == "smollm2"
    assert first.status in ("completed", "incomplete")
    (message,) = first.output
    assert message.type == "message" and message.role == "assistant"
    assert first.output_text and message.content[0].type == "output_text"
    assert 1 <= first.usage.output_tokens <= 4 and first.metadata == {"case": "chain"}
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"

    # The second turn's prompt is the first turn's (its instructions given again: OpenAI carries
    # none over), the answer, then the new input; the replica's prefix cache serves the start.
    second = client.responses.create(model="smollm2", input="And another?", previous_response_id=first.id,
                                     instructions="Answer in one word.", max_output_tokens=2, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # at least the first full block
    assert second.usage.total_tokens == second.usage.input_tokens + second.usage.output_tokens

    again = client.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert error_of(info.value)["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as bad:  # OpenAI's status and code for it
        client.responses.create(model="smollm2", input="Hi", previous_response_id=first.id)
    assert error_of(bad.value)["code"] == "previous_response_not_found"
    counted = scrape(server.base_url)
    assert counted["kvscale:http_requests_total{route=/v1/responses,status=200}"] >= 2


def test_stream_events_in_openai_order(client) -> None:
    stream = client.responses.create(
        model="smollm2", max_output_tokens=4, temperature=0, stream=True,
        input=[{"role": "system", "content": "Be brief."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}])
    events = list(stream)
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    last = "response.incomplete" if kinds[-1] == "response.incomplete" else "response.completed"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert events[-4].text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens <= 4
    assert final.output[0].content[0].logprobs == [] and events[-4].logprobs == []  # none asked for
    if last == "response.incomplete":
        assert final.status == "incomplete" and final.usage.output_tokens == 4
    else:
        assert final.status == "completed"
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == text and stored.usage.input_tokens == final.usage.input_tokens


def test_text_format_json_schema_and_store_false(client) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = client.responses.create(model="smollm2", input="Is Paris in France?", max_output_tokens=8,
                                     temperature=0, store=False,
                                     text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                      "strict": True}})
    assert answer.status == "completed" and answer.text.format.type == "json_schema"
    assert json.loads(answer.output_text) in ("yes", "no")
    with pytest.raises(openai.NotFoundError):  # store: false kept nothing
        client.responses.retrieve(answer.id)


def test_a_streamed_function_call_and_its_output(client) -> None:
    # The call's frame and the city's name are forced by the grammar (fast-forwarded), so the
    # call costs a few steps although it is some twenty tokens long.
    kinds = []
    with client.responses.stream(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        call_turn = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    (call,) = call_turn.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert call_turn.status == "completed" and call_turn.tools[0].name == "get_weather"

    answer = client.responses.create(
        model="smollm2", previous_response_id=call_turn.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        max_output_tokens=1, temperature=0)
    assert answer.output[0].type == "message"
    assert answer.usage.input_tokens > call_turn.usage.input_tokens + call_turn.usage.output_tokens
    assert client.responses.retrieve(call_turn.id).output[0].arguments == call.arguments


def test_output_text_logprobs_streamed_and_not(client) -> None:
    # Parsed with the official client's own types, validated (its stream parser only constructs).
    fields = {"model": "smollm2", "input": "Say hello.", "max_output_tokens": 2, "temperature": 0,
              "include": [LOGPROBS], "top_logprobs": 2}
    answer = Response.model_validate(client.post("/responses", body=fields, cast_to=dict))
    part = answer.output[0].content[0]
    assert len(part.logprobs) == answer.usage.output_tokens
    for entry in part.logprobs:
        assert bytes(entry.bytes) == entry.token.encode() and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token ranks first
    assert "".join(entry.token for entry in part.logprobs).startswith(part.text)
    assert client.responses.retrieve(answer.id).output[0].content[0].logprobs == part.logprobs

    events = [event.to_dict() for event in client.responses.create(**fields, stream=True)]
    deltas = [ResponseTextDeltaEvent.model_validate(e) for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [ResponseTextDoneEvent.model_validate(e) for e in events if e["type"] == "response.output_text.done"]
    streamed = [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
                for delta in deltas for lp in delta.logprobs]
    expected = [(lp.token, pytest.approx(lp.logprob, abs=1e-4),
                 [(t.token, pytest.approx(t.logprob, abs=1e-4)) for t in lp.top_logprobs]) for lp in part.logprobs]
    assert streamed == expected and "".join(d.delta for d in deltas) == done.text == part.text
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [(t, lp) for t, lp, _ in streamed]
    final = Response.model_validate(events[-1]["response"])
    assert final.output[0].content[0].logprobs == [
        Logprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[
            LogprobTopLogprob(token=tt, logprob=tlp, bytes=list(tt.encode())) for tt, tlp in top])
        for t, lp, top in streamed]


def test_logprobs_of_tokens_adding_no_text_come_in_a_delta_without_text() -> None:
    def entry(token: str) -> dict:
        top = {"token": token, "logprob": -0.5, "bytes": list(token.encode())}
        return {**top, "top_logprobs": [top]}

    body = ResponsesRequest.model_validate({"input": "Hi", "include": [LOGPROBS]})
    events = ResponseEvents(ResponseHead(body, "smollm2"))
    lines = [*events.opening(),
             *events.on_choice({"delta": {"content": "Hi"}, "logprobs": {"content": [entry("Hi")]}}),
             *events.on_choice({"delta": {}, "logprobs": {"content": [entry("")]}, "finish_reason": "stop"})]
    closing, response = events.closing({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
    sent = [json.loads(line.split("data: ", 1)[1]) for line in [*lines, *closing]]
    deltas = [ResponseTextDeltaEvent.model_validate(e) for e in sent if e["type"] == "response.output_text.delta"]
    assert [(d.delta, [lp.token for lp in d.logprobs]) for d in deltas] == [("Hi", ["Hi"]), ("", [""])]
    part = Response.model_validate(response).output[0].content[0]
    assert part.text == "Hi" and [lp.token for lp in part.logprobs] == ["Hi", ""]


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"reasoning": {"effort": "none", "summary": "auto"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include, no logprobs would come back
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
    ({"include": [LOGPROBS, "file_search_call.results"]}, "include"),
    ({"include": [LOGPROBS], "tools": [WEATHER]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "assistant", "content": "only an answer"}]}, "input"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"previous_response_id": "resp_unknown", "background": True}, "background"),  # refusals first
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    # Chat's refusals name the field as the Responses API calls it.
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "array", "uniqueItems": True}}}},
     "text.format"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, fields: dict, param: str) -> None:
    body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=dict)
    error = error_of(info.value)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if param in fields and param not in ("input", "metadata", "max_output_tokens"):
        assert param in error["message"]


def test_unknown_ids_and_models_are_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_never_stored")
    assert error_of(info.value)["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="Hi")
    assert error_of(info.value)["code"] == "model_not_found"
