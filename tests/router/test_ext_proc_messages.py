"""The endpoint picker's ext_proc exchange without a network: the messages it builds, and one
request's stream in each body mode answered by a real (unstarted) router's state."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvscale.drain import Drain
from kvscale.router import ext_proc_messages as msg
from kvscale.router.app import Router
from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.config import RouterConfig
from kvscale.router.ext_proc import EndpointPicker, endpoint_of, follow_drain, parse_body

Mode = processing_mode_pb2.ProcessingMode
REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def headers_message(headers: dict[str, str], mode: int, end_of_stream: bool = False) -> pb.ProcessingRequest:
    entries = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=entries), end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode))


def body_message(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def ready_router(healthy: bool = True) -> Router:
    router = Router(RouterConfig(replicas=REPLICAS, models=[]))
    for replica in router.replicas.replicas.values():
        replica.models = {"m"}
        replica.healthy = healthy
    return router


def run(router: Router, requests: list[pb.ProcessingRequest], max_body: int = 1 << 20) -> list[pb.ProcessingResponse]:
    async def drive() -> list[pb.ProcessingResponse]:
        async def stream():
            for request in requests:
                yield request
        return [answer async for answer in EndpointPicker(router, max_body).Process(stream(), None)]

    return asyncio.run(drive())


def destination(response: pb.ProcessingResponse, phase: str) -> tuple[str, str]:
    common = getattr(response, phase).response
    header = common.header_mutation.set_headers[0].header
    listed = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[msg.DESTINATION_HEADER]
    return header.raw_value.decode(), listed.string_value


BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()
HEAD = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


def test_full_duplex_holds_the_headers_until_the_body_ends_then_sends_it_back_whole() -> None:
    router = ready_router()
    answers = run(router, [headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED),
                           body_message(BODY[:10], False), body_message(BODY[10:], True)])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    chosen, listed = destination(answers[0], "request_headers")
    assert listed.split(",")[0] == chosen and set(listed.split(",")) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == BODY and streamed.end_of_stream
    # The request was open on its replica while its stream lived, and is closed now.
    assert all(r.in_flight == 0 for r in router.replicas.replicas.values())
    assert sum(r.last_finished > 0 for r in router.replicas.replicas.values()) == 1


def test_buffered_answers_the_headers_unchanged_and_routes_on_the_body() -> None:
    answers = run(ready_router(), [headers_message(HEAD, Mode.BUFFERED), body_message(BODY, True)])
    assert answers[0] == msg.headers_unchanged()
    chosen, listed = destination(answers[1], "request_body")
    assert chosen in {"10.0.0.1:8000", "10.0.0.2:8000"} and listed.startswith(chosen + ",")
    assert not answers[1].request_body.response.HasField("body_mutation")  # the body goes on as it is


def test_a_request_without_body_is_routed_on_its_headers() -> None:
    answers = run(ready_router(), [headers_message({":method": "GET", ":path": "/v1/models"},
                                                   Mode.FULL_DUPLEX_STREAMED, end_of_stream=True)])
    assert len(answers) == 1 and destination(answers[0], "request_headers")[0].startswith("10.0.0.")


def test_no_ready_replica_is_an_immediate_503_with_the_error_json() -> None:
    answers = run(ready_router(healthy=False), [headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED),
                                                 body_message(BODY, True)])
    immediate = answers[-1].immediate_response
    assert immediate.status.code == 503
    assert json.loads(immediate.body)["error"]["type"] == "service_unavailable"
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"


def test_a_body_over_the_cap_is_a_413_and_ends_the_stream() -> None:
    answers = run(ready_router(), [headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED),
                                   body_message(b"x" * 600, False), body_message(b"x" * 600, True)], max_body=1000)
    assert len(answers) == 1 and answers[0].immediate_response.status.code == 413


def test_invalid_json_and_a_non_string_model_are_400() -> None:
    assert isinstance(parse_body(b"[1]"), msg.Refusal) and parse_body(b"[1]").status == 400  # type: ignore[union-attr]
    assert parse_body(b'{"model": 3}').status == 400  # type: ignore[union-attr]
    assert parse_body(b"") == {}


def test_headers_are_read_from_raw_values_and_lower_cased() -> None:
    request = headers_message({"X-Session-ID": "abc", ":path": "/v1/chat/completions?x=1"}, Mode.BUFFERED)
    exchange = msg.Exchange(10)
    exchange.take_headers(request)
    assert exchange.headers["x-session-id"] == "abc" and exchange.path == "/v1/chat/completions"
    assert exchange.body_mode == Mode.BUFFERED and not exchange.full_duplex


def test_the_destination_header_overwrites_one_the_client_sent() -> None:
    option = msg.routed_common(["10.0.0.1:8000", "10.0.0.2:8000"]).header_mutation.set_headers[0]
    assert option.header.raw_value == b"10.0.0.1:8000"
    assert option.append_action == option.OVERWRITE_IF_EXISTS_OR_ADD


def test_endpoint_of_a_replica_url() -> None:
    assert endpoint_of("http://10.1.2.3:8000") == "10.1.2.3:8000"
    assert endpoint_of("http://[fd00::7]:8000/") == "[fd00::7]:8000"
    assert endpoint_of("http://10.1.2.3") == "10.1.2.3:80"


def test_the_picker_refuses_to_start_with_a_key_it_would_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--replicas", "http://10.0.0.1:8000", "--ext-proc-port", "9002", "--api-key", "k"])
    with pytest.raises(SystemExit, match="--ext-proc-port does not check --api-key"):
        config_from_args(args)
    args = parser.parse_args(["--replicas", "http://10.0.0.1:8000", "--ext-proc-port", "9002"])
    assert config_from_args(args).replicas == ["http://10.0.0.1:8000"] and args.ext_proc_port == 9002


def test_a_body_ended_by_trailers_is_decided_there() -> None:
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    answers = run(ready_router(), [headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED),
                                   body_message(BODY, False), trailers])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "request_trailers"]
    assert answers[1].request_body.response.body_mutation.streamed_response.body == BODY


def test_response_phases_the_gateway_sends_anyway_go_on_unchanged() -> None:
    phases = [pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
              pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x", end_of_stream=True))]
    answers = run(ready_router(), [headers_message(HEAD, Mode.BUFFERED), body_message(BODY, True), *phases])
    assert answers[2:] == [pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
                           pb.ProcessingResponse(response_body=pb.BodyResponse())]


def test_the_response_headers_tell_the_picker_its_prefill_is_done() -> None:
    """A replica sends a stream's headers with its first token: the gateway passing them on
    (response_header_mode SEND) is the picker's first byte. Its ledger then holds a request that
    started and finished (its prefill wait and decode measured), as the HTTP path's would; without
    them the request stayed "waiting for prefill" until its stream ended, and left no measure."""
    started = ready_router()
    run(started, [headers_message(HEAD, Mode.BUFFERED), body_message(BODY, True),
                  pb.ProcessingRequest(response_headers=pb.HttpHeaders())])
    unstarted = ready_router()
    run(unstarted, [headers_message(HEAD, Mode.BUFFERED), body_message(BODY, True)])
    for router, expected in ((started, 1), (unstarted, 0)):
        (served,) = [r for r in router.replicas.replicas.values() if r.last_finished > 0]
        ledger = router.in_flight.ledger(served.replica_id)
        assert ledger is not None
        entries = ledger.entries(time.monotonic())
        assert len(entries) == expected
        assert all(e.started_at is not None and e.finished_at is not None for e in entries)


def test_a_draining_router_turns_readiness_off_and_keeps_liveness() -> None:
    async def drive() -> dict[str, int]:
        health = health_aio.HealthServicer()
        for name in ("", *msg.HEALTH_SERVICES):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        drain = Drain()
        follower = asyncio.create_task(follow_drain(health, drain, every_s=0.001))
        await asyncio.sleep(0.01)
        assert not follower.done()  # not draining: nothing changes
        drain.draining = True
        await follower
        return {name: (await health.Check(health_pb2.HealthCheckRequest(service=name), None)).status
                for name in msg.HEALTH_SERVICES}

    statuses = asyncio.run(drive())
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == {"liveness": serving, "readiness": not_serving,
                        "envoy.service.ext_proc.v3.ExternalProcessor": not_serving}


def test_a_responses_turn_is_ranked_like_the_http_paths() -> None:
    body = json.dumps({"model": "m", "input": "hello", "max_output_tokens": 4}).encode()
    answers = run(ready_router(), [headers_message({**HEAD, ":path": "/v1/responses"}, Mode.BUFFERED),
                                   body_message(body, True)])
    assert destination(answers[1], "request_body")[0] in {"10.0.0.1:8000", "10.0.0.2:8000"}
