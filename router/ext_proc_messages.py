"""The endpoint picker's side of Envoy's external-processing (ext_proc) stream, without the network:
what one HTTP request's messages mean and the answers they get.

A gateway that routes by the Gateway API Inference Extension's endpoint-picker protocol (Istio,
agentgateway, NGINX Gateway Fabric, a hand-configured Envoy) opens one ext_proc stream per HTTP
request and sends its headers, then its body. The picker answers with the chosen replica's
``ip:port`` in the header ``x-gateway-destination-endpoint`` (read by an ORIGINAL_DST cluster) and
the same endpoint followed by the fallbacks, in retry order, in the dynamic metadata namespace
``envoy.lb``; or with an immediate error response. The body goes on unchanged.

Two body modes, as the gateway's filter is configured:
- BUFFERED: Envoy waits for the answer to the headers before it sends the whole body in one
  message; the headers are answered at once (unchanged) and the destination rides on the body's
  answer, which Envoy applies to the headers it still holds.
- FULL_DUPLEX_STREAMED (what llm-d's picker requires): the body's chunks come without waiting;
  the headers' answer is held until the body's last byte (the decision needs the prompt), then
  sent with the destination, followed by the body itself, whole, as one streamed chunk.

The Envoy API messages are those the ``xds-protos`` package generates from Envoy's
data-plane-api (published by the gRPC project with every grpcio release): the ext_proc service
and every message it references, importable as ``envoy.service.ext_proc.v3``, on the protobuf
runtime. ``envoy-data-plane`` has the same API only as betterproto dataclasses, which grpcio's
servers cannot carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# The names Envoy's gRPC health checks and GIE's gateways ask the picker about.
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@dataclass(frozen=True)
class Refusal:
    """An answer for the client in place of the upstream's: a status, an OpenAI error body and the
    headers the HTTP port would send with it (a 429's ``Retry-After`` and rate-limit headers)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Forwarded:
    """What the picker changes on the request it routes, so that the replica gets what the HTTP
    port would send it: headers set (the trusted ones: kvscale.router.proxy.trusted_headers),
    headers removed (a client's copy of a trusted one), and the body when the router rewrites it
    (a tenant's priority: kvscale.router.engine_priority)."""

    set_headers: dict[str, str] = field(default_factory=dict)
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None


UNCHANGED = Forwarded()


@dataclass
class Exchange:
    """One request's stream: its headers and the body gathered so far, at most ``max_body_bytes``."""

    max_body_bytes: int
    headers: dict[str, str] = field(default_factory=dict)
    body_mode: int = processing_mode_pb2.ProcessingMode.NONE
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    decided: bool = False

    @property
    def full_duplex(self) -> bool:
        return self.body_mode == FULL_DUPLEX

    @property
    def path(self) -> str:
        return self.headers.get(":path", "").split("?", 1)[0]

    def take_headers(self, request: pb.ProcessingRequest) -> None:
        self.headers = headers_of(request.request_headers)
        if request.HasField("protocol_config"):
            self.body_mode = request.protocol_config.request_body_mode

    def add_chunk(self, chunk: bytes) -> bool:
        """Keep a body chunk; False when the body has grown past the cap (nothing kept then)."""
        self.size += len(chunk)
        if self.size > self.max_body_bytes:
            return False
        self.chunks.append(chunk)
        return True

    def body(self) -> bytes:
        return b"".join(self.chunks)


def headers_of(headers: pb.HttpHeaders) -> dict[str, str]:
    """The request's headers, names lower-cased; Envoy sends values as ``raw_value`` bytes."""
    out: dict[str, str] = {}
    for header in headers.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out.setdefault(header.key.lower(), value)
    return out


def destination_value(endpoints: list[str]) -> str:
    """Endpoints in retry order, as the protocol's metadata carries them."""
    return ",".join(endpoints)


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routed_mutation(endpoints: list[str], forwarded: Forwarded = UNCHANGED) -> pb.HeaderMutation:
    """Set the destination header to the chosen endpoint, over any the client sent: an
    ORIGINAL_DST cluster reads one ``ip:port`` from it (given a list, Envoy finds no host and
    answers 503), so the fallbacks ride in the metadata only. Then what ``forwarded`` changes,
    and the length of a rewritten body."""
    wanted = {DESTINATION_HEADER: endpoints[0], **forwarded.set_headers}
    if forwarded.body is not None:
        wanted["content-length"] = str(len(forwarded.body))
    return pb.HeaderMutation(set_headers=[set_header(k, v) for k, v in wanted.items()],
                             remove_headers=[h for h in forwarded.remove_headers if h not in wanted])


def routed_common(endpoints: list[str], forwarded: Forwarded = UNCHANGED) -> pb.CommonResponse:
    return pb.CommonResponse(header_mutation=routed_mutation(endpoints, forwarded))


def destination_metadata(endpoints: list[str]) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: destination_value(endpoints)}})
    return metadata


def headers_routed(endpoints: list[str], forwarded: Forwarded = UNCHANGED) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=routed_common(endpoints, forwarded)),
        dynamic_metadata=destination_metadata(endpoints))


def body_routed(endpoints: list[str], forwarded: Forwarded = UNCHANGED) -> pb.ProcessingResponse:
    """BUFFERED: the body's answer carries the destination (Envoy still holds the headers), and
    the body when the router rewrote it."""
    common = routed_common(endpoints, forwarded)
    if forwarded.body is not None:
        common.body_mutation.body = forwarded.body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=destination_metadata(endpoints))


def headers_unchanged() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def body_unchanged() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def body_streamed(body: bytes) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the body goes upstream only as the picker sends it back."""
    streamed = pb.StreamedBodyResponse(body=body, end_of_stream=True)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=streamed))))


def trailers_unchanged() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def immediate(refusal: Refusal) -> pb.ProcessingResponse:
    headers = [set_header("content-type", "application/json"), *(set_header(k, v) for k, v in refusal.headers)]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status),
        headers=pb.HeaderMutation(set_headers=headers), body=refusal.body))


def routed_answers(exchange: Exchange, endpoints: list[str], trailers: bool = False,
                   forwarded: Forwarded = UNCHANGED) -> list[pb.ProcessingResponse]:
    """The answers once the request is decided at the end of its body (or of its trailers)."""
    if exchange.full_duplex:
        body = forwarded.body if forwarded.body is not None else exchange.body()
        answers = [headers_routed(endpoints, forwarded), body_streamed(body)]
    else:
        answers = [body_routed(endpoints, forwarded)]
    return answers + ([trailers_unchanged()] if trailers else [])


def response_status(headers: pb.HttpHeaders) -> int:
    """The upstream's status from the response headers' ``:status`` (0 when absent)."""
    status = headers_of(headers).get(":status", "")
    return int(status) if status.isdigit() else 0


def response_headers_added(headers: dict[str, str]) -> pb.ProcessingResponse:
    """The response's headers let through with ``headers`` added (a tenant's rate-limit
    headers, which the HTTP port adds to its answers)."""
    mutation = pb.HeaderMutation(set_headers=[set_header(k, v) for k, v in headers.items()])
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=mutation)))


def passthrough_answer(request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
    """A response phase the gateway sent although the picker has nothing to do with it (the
    documented configuration skips them): let it through unchanged."""
    kind = request.WhichOneof("request")
    if kind == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if kind == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if kind == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return None
