"""The event-loop side of the engine: one asyncio stream per request, whatever runs the engine.

``EngineFront`` is what the HTTP handlers talk to: it opens a stream per request, ends it on an
abort, hands each step's outputs to their streams and fails every stream when the engine dies.
Where the engine runs is its subclass's business: ``EngineCoreClient`` (engine_core_client.py)
talks to an engine core process, what ``kvscale serve`` runs.

The event loop hears back once per engine step: one callback carrying every output of the step
plus a stats snapshot, so the loop wakes once per step however many requests are running.
Outputs are deltas (each step's new text, tokens and logprobs), so nothing grows with the length
of an answer.

That callback is also how a stuck engine shows: an engine loop answers after every step and at
least every ``IDLE_TICK_S`` when idle (core_loop.py), so silence longer than
``step_timeout_s`` while requests are open means a step has run that long, and ``health_problem``
says so (/health answers 503: docs/server.md, "Engine failure"). The bound is vLLM's
``VLLM_ENGINE_ITERATION_TIMEOUT_S``, here ``KVSCALE_ENGINE_STEP_TIMEOUT_S`` (60 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.engine.core_loop import NewRequest
from kvscale.server.outputs import EngineStats, RequestOutput, merge_deltas
from kvscale.server.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped; no request can make progress."""


DEFAULT_STEP_TIMEOUT_S = 60.0


def step_timeout_from_env() -> float | None:
    """``KVSCALE_ENGINE_STEP_TIMEOUT_S``: seconds a step may run before /health fails (0: never)."""
    value = float(os.environ.get("KVSCALE_ENGINE_STEP_TIMEOUT_S", DEFAULT_STEP_TIMEOUT_S))
    return value if value > 0 else None


def stalled_for(now: float, last_heard: float, busy: bool, step_timeout_s: float | None) -> float | None:
    """How long the engine has been silent while it has work, if past ``step_timeout_s``."""
    silent = now - last_heard
    if step_timeout_s is None or not busy or silent <= step_timeout_s:
        return None
    return silent


_NOTHING = object()


@dataclass
class RequestStream:
    """What the HTTP side reads for one request: the engine's delta outputs, in order.

    A reader that falls behind gets what it missed folded into one output (``merge_deltas``).
    ``aborted`` means the request ended early (client gone, engine dead).

    ``stream_interval`` (vLLM's ``--stream-interval``): after the first token, deltas are held
    until they carry that many tokens (or the request ends) before the reader wakes, so a stream
    costs the front end and its client one event per that many tokens instead of one per token.
    """

    request_id: str
    num_prompt_tokens: int
    stream_interval: int = 1
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    aborted: bool = False
    # Bookkeeping for per-token metrics, kept here because every output passes through.
    tokens_seen: int = 0
    last_token_time: float | None = None
    first_output_seen: bool = False
    _held: Any = _NOTHING  # an end (None, an error) read while folding deltas; returned next
    _first_token_put: bool = False
    _holding: list[RequestOutput] = field(default_factory=list)  # below the stream interval
    _holding_tokens: int = 0

    def put(self, item: RequestOutput | BaseException | None) -> None:
        if self.stream_interval > 1 and isinstance(item, RequestOutput):
            tokens = max((len(completion.token_ids) for completion in item.outputs), default=0)
            if self._first_token_put and not item.finished and item.error is None:
                self._holding.append(item)
                self._holding_tokens += tokens
                if self._holding_tokens >= self.stream_interval:
                    self._release_held()
                return
            self._first_token_put = self._first_token_put or tokens > 0
        self._release_held()
        self._queue.put_nowait(item)

    def _release_held(self) -> None:
        if self._holding:
            self._queue.put_nowait(merge_deltas(self._holding))
            self._holding, self._holding_tokens = [], 0

    async def next(self) -> RequestOutput | None:
        """Everything new since the last call as one output (None once aborted); raises
        EngineDeadError if the engine died."""
        if self._held is not _NOTHING:
            item, self._held = self._held, _NOTHING
        else:
            item = await self._queue.get()
        if isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            deltas = [item]
            while not self._queue.empty() and not deltas[-1].finished:
                following = self._queue.get_nowait()
                if not isinstance(following, RequestOutput):
                    self._held = following
                    break
                deltas.append(following)
            item = merge_deltas(deltas)
        if isinstance(item, BaseException):
            raise item
        return item


class EngineFront:
    """The event-loop side of every request, whatever runs the engine.

    ``on_step(outputs, streams, stats)`` and ``on_request_end(stream, finish_reason)`` run on the
    event loop (metrics hang off them). A subclass starts and stops the engine and carries adds
    and aborts to it (``_submit``, ``_send_abort``); it calls ``_on_accepted`` when the engine
    took or refused a batch of adds, ``_on_step_done`` after every step and ``_fail_all`` when
    the engine died, all on the event loop.
    """

    def __init__(
        self,
        *,
        on_step: Callable[[list[RequestOutput], dict[str, RequestStream], EngineStats], None] | None = None,
        on_request_end: Callable[[RequestStream, str], None] | None = None,
    ) -> None:
        self._on_step = on_step
        self._on_request_end = on_request_end
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.stats: EngineStats | None = None
        # Adds submitted but not yet taken by the engine count as waiting, so a burst arriving
        # within one step cannot overrun --max-queue-len.
        self.num_pending_adds = 0
        self.step_timeout_s = step_timeout_from_env()
        self._last_heard = time.monotonic()  # the engine's last step (or idle tick) answered

    def observe(
        self,
        on_step: Callable[[list[RequestOutput], dict[str, RequestStream], EngineStats], None],
        on_request_end: Callable[[RequestStream, str], None],
    ) -> None:
        """Hook the metrics in (both run on the event loop)."""
        self._on_step = on_step
        self._on_request_end = on_request_end

    # ------------------------------------------------------------------ what a subclass provides

    def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, requests: list[NewRequest], accepted: asyncio.Future, tenant: str = "",
                lora_name: str = "", priority: int = 0) -> None:
        """Carry a batch of adds (one tenant's: core_loop.add_all) to the engine;
        ``_on_accepted`` answers it later."""
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def update_lora(self, name: str, path: str | None) -> tuple[str, str] | None:
        """Register the LoRA adapter ``name`` at ``path`` in the engine, or forget it (``path``
        None): None, or engine/lora_updates.py's (kind, why) of a refusal."""
        return "invalid", "this engine does not load LoRA adapters at run time"

    # ------------------------------------------------------------------ requests (event loop)

    @property
    def num_waiting(self) -> int:
        waiting = self.stats.num_waiting if self.stats else 0
        return waiting + self.num_pending_adds

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        num_prompt_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Hand one request to the engine; see ``add_requests``."""
        (stream,) = await self.add_requests([(request_id, prompt, params, cache_salt)])
        return stream

    async def add_requests(self, requests: Sequence[NewRequest], *, stream_interval: int = 1,
                           tenant: str = "", lora_name: str = "", priority: int = 0) -> list[RequestStream]:
        """Hand requests to the engine in one go (they start in the same step); returns their
        streams (``RequestStream.stream_interval``) once the engine accepted all of them.
        ``tenant``: the router's, for fair admission (server/core/admission_order.py);
        ``lora_name``: the LoRA adapter serving them all ("": the base model); ``priority``:
        theirs under --scheduling-policy priority (server/core/priority_order.py).

        Raises what ``LLMEngine.add_request`` raised for the first it refused (none is kept
        then), or EngineDeadError.
        """
        if not self.is_alive:
            raise EngineDeadError(self.death_reason())
        assert self._loop is not None
        ids = [request_id for request_id, *_ in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError("request ids must be unique and not in use")
        if not self._streams and not self.num_pending_adds:
            # Work starts now: an engine that does not tick while idle was silent for nothing.
            self._last_heard = time.monotonic()
        streams = []
        for request_id, prompt, _, _ in requests:
            stream = RequestStream(request_id=request_id,
                                   num_prompt_tokens=len(prompt) if isinstance(prompt, list) else 0,
                                   stream_interval=stream_interval)
            self._streams[request_id] = stream
            streams.append(stream)
        accepted: asyncio.Future = self._loop.create_future()
        # Every sequence: a prompt with n > 1 forks into n once prefilled.
        self.num_pending_adds += sum(params.n for _, _, params, _ in requests)
        self._submit(list(requests), accepted, tenant, lora_name, priority)
        try:
            error = await accepted
        except BaseException:
            # Cancelled while waiting (client gone): the engine may still take them; abort them.
            for request_id in ids:
                self.abort(request_id)
            raise
        if error is not None:
            for request_id in ids:
                self._streams.pop(request_id, None)
            raise error
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request now: its stream ends at once, the engine frees its blocks next."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.aborted = True
        stream.put(None)
        if self._on_request_end is not None:
            self._on_request_end(stream, "abort")
        if self.is_alive:
            self._send_abort(request_id)

    def release(self, stream: RequestStream) -> None:
        """Call when the reader is done with a stream; aborts it if it has not finished."""
        if not stream.finished:
            self.abort(stream.request_id)

    def health_problem(self) -> str | None:
        """Why /health must fail (the engine died, or a step has run past ``step_timeout_s``), or
        None."""
        if not self.is_alive:
            return self.death_reason()
        busy = bool(self._streams) or self.num_pending_adds > 0
        silent = stalled_for(time.monotonic(), self._last_heard, busy, self.step_timeout_s)
        if silent is None:
            return None
        return (f"the engine has not finished a step in {silent:.0f} s, longer than "
                f"{self.step_timeout_s:g} s (KVSCALE_ENGINE_STEP_TIMEOUT_S): it is stuck")

    def death_reason(self) -> str:
        if self.error is None:
            return "the engine is not running"
        return f"the engine stopped: {type(self.error).__name__}: {self.error}"

    # ------------------------------------------------------------------ engine answers (event loop)

    def _on_accepted(self, requests: list[NewRequest], accepted: asyncio.Future,
                     error: BaseException | None) -> None:
        self.num_pending_adds -= sum(params.n for _, _, params, _ in requests)
        if accepted.done():  # the caller was cancelled and already asked for an abort
            return
        accepted.set_result(error)

    def _on_step_done(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._last_heard = time.monotonic()
        self.stats = stats
        if self._on_step is not None:
            self._on_step(outputs, self._streams, stats)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted by us already
                continue
            stream.put(output)
            if output.finished:
                stream.finished = True
                del self._streams[output.request_id]
                if self._on_request_end is not None:
                    reason = next((o.finish_reason for o in output.outputs if o.finish_reason), "stop")
                    self._on_request_end(stream, reason)

    def _fail_all(self, exc: BaseException) -> EngineDeadError:
        """Every open stream gets the error; returns it, for the adds still waiting."""
        if self.error is None:
            self.error = exc
        error = EngineDeadError(self.death_reason())
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        self.num_pending_adds = 0
        return error
