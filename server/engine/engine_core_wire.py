"""The messages between the HTTP front end and the engine core process, and their encoding.

Front end -> core: ``AddRequests`` (a batch that starts in the same step), ``AbortRequests``,
``Shutdown``. Core -> front end: ``Ready`` (once, when warmed up), ``Accepted`` (a batch taken or
refused), ``StepDone`` (a step's delta outputs and a stats snapshot), ``CoreFailed`` (the core's
last words before it exits).

msgspec encodes them as MessagePack. The engine's own dataclasses (SamplingParams, RequestOutput,
EngineStats) travel as they are: msgspec reads their fields from their type hints, so a field
someone adds to one of them crosses the wire with no change here. KV events never cross: the
core publishes them to Redis itself (engine_core.py).
"""

from __future__ import annotations

import msgspec

from kvscale.server.outputs import EngineStats, RequestOutput
from kvscale.server.sampling_params import SamplingParams


class NewRequestMsg(msgspec.Struct, array_like=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    batch_id: int
    requests: list[NewRequestMsg]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


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


ToCore = AddRequests | AbortRequests | Shutdown
FromCore = Ready | Accepted | StepDone | CoreFailed


class Codec:
    """One encoder and the decoder for the direction this side reads (both reuse buffers)."""

    def __init__(self, reads: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(reads)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> ToCore | FromCore:
        return self._decoder.decode(data)


def core_codec() -> Codec:
    return Codec(ToCore)  # type: ignore[arg-type]


def front_codec() -> Codec:
    return Codec(FromCore)  # type: ignore[arg-type]
