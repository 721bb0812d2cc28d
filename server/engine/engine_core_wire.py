"""The messages between the HTTP front end and the engine core process, and their encoding.

Front end -> core: ``AddRequests`` (a batch that starts in the same step), ``AbortRequests``,
``UpdateLoRA`` (an adapter loaded or unloaded at run time), ``Shutdown``. Core -> front end:
``Ready`` (once, when warmed up), ``Accepted`` (a batch taken or refused), ``LoRAUpdated`` (an
update done or refused), ``StepDone`` (a step's delta outputs and a stats snapshot),
``CoreFailed`` (the core's last words before it exits).

A batch's request-wide fields (``stop``, ``stop_token_ids``, ``logit_bias``, a grammar) travel
once per request, not once per prompt: the HTTP side gives a request's prompts SamplingParams
that share these objects (SamplingParams.with_max_tokens), the encoder sends each distinct set
once in ``AddRequests.shared`` with the prompts pointing at it, and the decoder hands every
prompt the same objects again (docs/server.md "Request limits").

msgspec encodes them as MessagePack. The engine's own dataclasses (SamplingParams, RequestOutput,
EngineStats) travel as they are: msgspec reads their fields from their type hints, so a field
someone adds to one of them crosses the wire with no change here. KV events never cross: the
core publishes them to Redis itself (engine_core.py).
"""

from __future__ import annotations

import copy

import msgspec

from kvscale.server.outputs import EngineStats, RequestOutput
from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams


class NewRequestMsg(msgspec.Struct, array_like=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None
    shared: int = -1  # on the wire: its request-wide fields are AddRequests.shared[shared]


class RequestWide(msgspec.Struct, array_like=True):
    """The fields of SamplingParams that every prompt of one request has in common and that may
    be large."""

    stop: list[str]
    stop_token_ids: list[int]
    logit_bias: dict[int, float] | None
    structured_outputs: StructuredOutputsParams | None


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    batch_id: int
    requests: list[NewRequestMsg]
    shared: list[RequestWide] = []  # filled by the encoder, emptied by the decoder
    tenant: str = ""  # the batch's tenant (core_loop.add_all), "" for none
    lora_name: str = ""  # the batch's LoRA adapter (core_loop.add_all), "" for the base model
    priority: int = 0  # the batch's priority (--scheduling-policy priority), lower first


def _wide_key(params: SamplingParams) -> tuple[int, int, int, int] | None:
    """Prompts whose params hold the very same objects share one entry (found by identity, not
    by value: hashing a large logit_bias per prompt is the cost this avoids)."""
    if not (params.stop or params.stop_token_ids or params.logit_bias or params.structured_outputs):
        return None
    return (id(params.stop), id(params.stop_token_ids), id(params.logit_bias), id(params.structured_outputs))


def pack(message: AddRequests) -> AddRequests:
    """``message`` as sent: each distinct set of request-wide fields once (the caller's
    SamplingParams are left as they are)."""
    shared: list[RequestWide] = []
    index: dict[tuple[int, int, int, int], int] = {}
    requests = []
    for request in message.requests:
        params = request.params
        key = _wide_key(params)
        if key is None:
            requests.append(request)
            continue
        if key not in index:
            index[key] = len(shared)
            shared.append(RequestWide(params.stop, params.stop_token_ids, params.logit_bias,
                                      params.structured_outputs))
        bare = copy.copy(params)
        bare.stop, bare.stop_token_ids, bare.logit_bias, bare.structured_outputs = [], [], None, None
        requests.append(NewRequestMsg(request.request_id, request.prompt, bare, request.cache_salt,
                                      index[key]))
    return AddRequests(message.batch_id, requests, shared, message.tenant, message.lora_name,
                       message.priority) if shared else message


def unpack(message: AddRequests) -> AddRequests:
    """The batch as the front end built it: every prompt of a request holding the same objects."""
    if not message.shared:
        return message
    checked: set[int] = set()
    for request in message.requests:
        if request.shared >= 0:
            wide = message.shared[request.shared]
            params = request.params
            params.stop, params.stop_token_ids = wide.stop, wide.stop_token_ids
            params.logit_bias, params.structured_outputs = wide.logit_bias, wide.structured_outputs
            if request.shared not in checked:  # the rest were checked as they were decoded
                checked.add(request.shared)
                params.validate()
            request.shared = -1
    message.shared = []
    return message


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class UpdateLoRA(msgspec.Struct, tag=True, array_like=True):
    """Register the LoRA adapter ``name`` at ``path``, or forget it (``path`` None): engine/lora_updates.py."""

    op_id: int
    name: str
    path: str | None = None


class LoRAUpdated(msgspec.Struct, tag=True, array_like=True):
    op_id: int
    # None: done. Else engine/lora_updates.py's kind of refusal and why.
    error_kind: str | None = None
    error: str | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    """What the front end needs to know of the engine before it serves."""

    pid: int
    model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    num_blocks: int
    stats: EngineStats
    warm_up_s: float
    frozen_objects: int = 0  # start-up objects moved out of the garbage collector's reach


class Accepted(msgspec.Struct, tag=True, array_like=True):
    batch_id: int
    # None: every request of the batch was added. Else none was: "invalid" (the request's fault,
    # a 400) or "internal" (a bug, a 500), and why.
    error_kind: str | None = None
    error: str | None = None


class StepDone(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    reason: str
    # "invalid": a flag was wrong (start-up), "internal": anything else.
    kind: str = "internal"


ToCore = AddRequests | AbortRequests | UpdateLoRA | Shutdown
FromCore = Ready | Accepted | LoRAUpdated | StepDone | CoreFailed


class Codec:
    """One encoder and the decoder for the direction this side reads (both reuse buffers)."""

    def __init__(self, reads: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(reads)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(pack(message) if isinstance(message, AddRequests) else message)

    def decode(self, data: bytes) -> ToCore | FromCore:
        message = self._decoder.decode(data)
        return unpack(message) if isinstance(message, AddRequests) else message


def core_codec() -> Codec:
    return Codec(ToCore)  # type: ignore[arg-type]


def front_codec() -> Codec:
    return Codec(FromCore)  # type: ignore[arg-type]
