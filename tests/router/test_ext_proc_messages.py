"""The endpoint picker's ext_proc exchange without a network: the messages it builds, and one
request's stream in each body mode answered by a real (unstarted) router's state."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvscale.drain import Drain
from kvscale.kv_index_schema import Heartbeat
from kvscale.router import ext_proc_messages as msg
from kvscale.router.app import Router
from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.config import RouterConfig
from kvscale.router.errors import openai_error
from kvscale.router.ext_proc import (
    EndpointPicker,
    endpoint_of,
    follow_drain,
    parse_body,
    refusal_of,
)
from kvscale.router.tenants import TenantFile
from kvscale.tenant_limits_schema import TENANT_HEADER

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


def test_the_picker_starts_with_a_key_or_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--replicas", "http://10.0.0.1:8000", "--ext-proc-port", "9002", "--api-key", "k"])
    assert config_from_args(args).api_key == "k" and args.ext_proc_port == 9002


def tenant_router(tmp_path: Path, **fields: object) -> Router:
    path = tmp_path / "tenants.yaml"
    path.write_text("- {name: team-a, api_key: sk-a, priority: 0}\n")
    router = Router(RouterConfig(replicas=REPLICAS, models=[], tenants=TenantFile(path), **fields))  # type: ignore[arg-type]
    for replica in router.replicas.replicas.values():
        replica.models, replica.healthy = {"m"}, True
    return router


def set_and_removed(mutation: pb.HeaderMutation) -> tuple[dict[str, str], list[str]]:
    return ({o.header.key: o.header.raw_value.decode() for o in mutation.set_headers},
            list(mutation.remove_headers))


def test_a_missing_or_unknown_key_is_a_401_from_the_head(tmp_path: Path) -> None:
    for head in (HEAD, {**HEAD, "authorization": "Bearer sk-nobody"}):
        answers = run(tenant_router(tmp_path), [headers_message(head, Mode.FULL_DUPLEX_STREAMED),
                                                body_message(BODY, True)])
        assert len(answers) == 1  # answered on the headers: the body is never looked at
        assert answers[0].immediate_response.status.code == 401
        assert json.loads(answers[0].immediate_response.body)["error"]["code"] == "invalid_api_key"
    probe = {":method": "GET", ":path": "/health"}  # open, as on the HTTP port
    answers = run(tenant_router(tmp_path), [headers_message(probe, Mode.BUFFERED, end_of_stream=True)])
    assert answers[0].HasField("request_headers")


def test_the_replica_gets_the_trusted_headers_the_http_port_would_send(tmp_path: Path) -> None:
    """The tenant and the replicas' key set over the client's copies; a client's lower priority
    than its tenant's band becomes the band's, in the body and its length."""
    body = json.dumps({"model": "m", "prompt": "hi", "priority": -3}).encode()
    head = {**HEAD, "authorization": "Bearer sk-a", TENANT_HEADER: "team-z"}
    router = tenant_router(tmp_path, replica_api_key="sk-replicas", scheduling_policy="priority")
    streamed = run(router, [headers_message(head, Mode.FULL_DUPLEX_STREAMED), body_message(body, True)])
    headers, removed = set_and_removed(streamed[0].request_headers.response.header_mutation)
    sent = streamed[1].request_body.response.body_mutation.streamed_response.body
    assert json.loads(sent) == {"model": "m", "prompt": "hi", "priority": 0}
    assert headers[TENANT_HEADER] == "team-a" and headers["authorization"] == "Bearer sk-replicas"
    assert headers["content-length"] == str(len(sent)) and removed == []
    buffered = run(tenant_router(tmp_path), [headers_message(head, Mode.BUFFERED), body_message(BODY, True)])
    common = buffered[1].request_body.response
    headers, removed = set_and_removed(common.header_mutation)
    # No replicas' key: the client's key (the router's) goes no further; the body as it came.
    assert headers[TENANT_HEADER] == "team-a" and removed == ["authorization"]
    assert not common.HasField("body_mutation") and "content-length" not in headers


def test_without_tenants_a_clients_tenant_header_is_removed() -> None:
    head = {**HEAD, TENANT_HEADER: "team-z"}
    answers = run(ready_router(), [headers_message(head, Mode.BUFFERED), body_message(BODY, True)])
    assert set_and_removed(answers[1].request_body.response.header_mutation)[1] == [TENANT_HEADER]


def test_the_usage_in_an_answers_tail_is_counted_to_its_tenant(tmp_path: Path) -> None:
    """With the answers' bodies sent to the picker (response_body_mode STREAMED), the usage near
    the end of the last chunks is what the HTTP path reads from its tail."""
    usage = b'"usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}'
    head = {**HEAD, "authorization": "Bearer sk-a"}
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    router = tenant_router(tmp_path)
    run(router, [headers_message(head, Mode.BUFFERED), body_message(BODY, True),
                 pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)),
                 pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"id": "c", ' + b" " * 5000)),
                 pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True))])
    assert router.metrics.tenant_tokens.labels("team-a")._value.get() == 10


def test_a_refusal_keeps_the_http_ports_headers() -> None:
    response = openai_error(429, "slow down", "requests", "rate_limit_exceeded")
    response.headers["retry-after"] = "7"
    immediate = msg.immediate(refusal_of(response)).immediate_response
    assert {o.header.key: o.header.raw_value for o in immediate.headers.set_headers} == {
        "content-type": b"application/json", "retry-after": b"7"}


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


def queueing_router(running: int, max_queue_wait_s: float = 30.0) -> tuple[Router, SimpleNamespace]:
    """A router with --max-queue-wait over one replica whose heartbeat says ``running`` of its
    batch of one (as the Redis feed would hold it). The 30 s default outlasts any pause of a busy
    machine in a test that releases or cancels its held request itself."""
    router = Router(RouterConfig(replicas=REPLICAS[:1], models=[], max_queue_wait_s=max_queue_wait_s))
    replica = next(iter(router.replicas.replicas.values()))
    replica.models, replica.healthy = {"m"}, True
    beat = Heartbeat(replica.replica_id, "m", REPLICAS[0], 16, running, 0, 1, 100, time.time(), max_num_seqs=1)
    feed = SimpleNamespace(heartbeats={replica.replica_id: beat}, healthy=True, healthy_since=time.monotonic())
    router.heartbeats.feed = feed
    return router, feed


async def held_in_queue(router: Router, waiting: int) -> None:
    """Until the picker's stream has reached the queue: a few loop turns, more on a busy machine;
    a picker that answers instead of holding never gets there."""
    assert router.queue is not None
    deadline = time.monotonic() + 10
    while router.queue.waiting != waiting:
        assert time.monotonic() < deadline, f"{router.queue.waiting} held, not {waiting}"
        await asyncio.sleep(0.005)


def open_requests(router: Router) -> int:
    return sum(r.in_flight for r in router.replicas.replicas.values())


def test_the_picker_holds_a_request_in_the_fair_queue_and_answers_it_when_a_slot_frees() -> None:
    router, feed = queueing_router(running=1)
    assert router.queue is not None

    async def drive() -> tuple[list[pb.ProcessingResponse], int]:
        ended = asyncio.Event()

        async def stream() -> AsyncIterator[pb.ProcessingRequest]:
            yield headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED)
            yield body_message(BODY, True)
            await ended.wait()  # the gateway closes the stream once the answer has passed

        answers = EndpointPicker(router, 1 << 20).Process(stream(), None)
        first = asyncio.ensure_future(anext(answers))
        await held_in_queue(router, 1)
        assert not first.done()  # nothing answered: Envoy holds it
        rid = next(iter(feed.heartbeats))
        feed.heartbeats[rid] = dataclasses.replace(feed.heartbeats[rid], num_running=0, timestamp=time.time())
        router.queue.dispatch()
        routed = [await first, await anext(answers)]
        open_while_streaming = len(router.queue.unsent) + open_requests(router)
        ended.set()
        routed += [answer async for answer in answers]
        return routed, open_while_streaming

    answers, open_while_streaming = asyncio.run(drive())
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert open_while_streaming == 1  # on the replica's count, no longer the queue's
    assert router.queue.waiting == 0 and not router.queue.unsent and open_requests(router) == 0


def test_the_picker_answers_a_request_held_past_max_queue_wait_as_the_http_port_does() -> None:
    router, _ = queueing_router(running=1, max_queue_wait_s=0.3)
    answers = run(router, [headers_message(HEAD, Mode.BUFFERED), body_message(BODY, True)])
    assert answers[0] == msg.headers_unchanged()
    immediate = answers[1].immediate_response
    headers = {o.header.key: o.header.raw_value for o in immediate.headers.set_headers}
    assert immediate.status.code == 503 and headers["retry-after"] == b"1"
    assert headers["content-type"] == b"application/json"
    assert json.loads(immediate.body)["error"]["code"] == "overloaded"
    assert router.queue is not None and router.queue.waiting == 0


def test_a_picker_stream_cancelled_while_held_leaves_the_queue() -> None:
    """Envoy resets the stream as the request's client leaves: the handler is cancelled."""
    router, _ = queueing_router(running=1)
    assert router.queue is not None

    async def drive() -> None:
        async def stream() -> AsyncIterator[pb.ProcessingRequest]:
            yield headers_message(HEAD, Mode.FULL_DUPLEX_STREAMED)
            yield body_message(BODY, True)

        held = asyncio.ensure_future(anext(EndpointPicker(router, 1 << 20).Process(stream(), None)))
        await held_in_queue(router, 1)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held

    asyncio.run(drive())
    assert router.queue.waiting == 0 and not router.queue.queues
    assert router.metrics.registry.get_sample_value("kvscale_router_queue_waits_total", {"outcome": "disconnected"}) == 1
