"""The front end's handle on the engine core process: starts it, talks to it, notices its death.

Two ZMQ sockets on IPC paths in a private folder, both bound here: the front end PUSHes adds,
aborts and the shutdown to the core's PULL; the core PUSHes back to the front end's PULL, which an
asyncio task reads. ``launch`` starts the core, loads the front end's tokenizer meanwhile, and
blocks until the core is warmed up (or failed, with its reason); ``start`` (on the event loop)
begins reading. The process's sentinel is watched by the event loop: when the core dies (a crash,
the OOM killer, SIGKILL) the log says how, every open stream and waiting add gets EngineDeadError
and the front end's ``is_alive`` is false, so /health and new requests answer 503. The reading task
is watched the same way: if it ends (a message it cannot decode, a bug in what it calls) nothing
more would be heard from the core, so the engine counts as dead too. A core that lives but is stuck
in a step is EngineFront's ``health_problem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from kvscale.server.config import EngineConfig
from kvscale.server.engine.core_loop import NewRequest
from kvscale.server.engine.cpu_binding import CpuSplit, core_threads
from kvscale.server.engine.engine_core import CoreSettings, PublisherSettings, run_engine_core
from kvscale.server.engine.engine_core_wire import (
    AbortRequests,
    Accepted,
    AddRequests,
    CoreFailed,
    LoRAUpdated,
    NewRequestMsg,
    Ready,
    Shutdown,
    StepDone,
    UpdateLoRA,
    front_codec,
)
from kvscale.server.engine.engine_front import EngineFront
from kvscale.server.engine.kv_events_config import KVEventsConfig
from kvscale.server.engine.output_text import OutputText

logger = logging.getLogger("kvscale.engine_core_client")

STOP_TIMEOUT_S = 30.0


class EngineCoreDied(RuntimeError):
    """The engine core process is gone."""


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, as a log line says it."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def bind_core_sockets(folder: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The front end's two sockets to the core, bound in ``folder``: requests out on
    ``ipc://FOLDER/input``, the core's answers in on ``ipc://FOLDER/output``."""
    context = zmq.Context()
    to_core = context.socket(zmq.PUSH)
    to_core.setsockopt(zmq.LINGER, 0)
    to_core.bind(f"ipc://{folder}/input")
    from_core = context.socket(zmq.PULL)
    from_core.setsockopt(zmq.LINGER, 0)
    from_core.bind(f"ipc://{folder}/output")
    return context, to_core, from_core


class EngineCoreClient(EngineFront):
    def __init__(self, process: Any, context: zmq.Context, inbox: zmq.Socket, outbox: zmq.Socket,
                 folder: str, ready: Ready, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self._text = OutputText(tokenizer)  # the core sends token ids; their text is made here
        self._process = process
        self._context = context
        self._to_core = inbox
        self._from_core = outbox
        self._folder = folder
        self.ready = ready
        self.pid = ready.pid
        self.stats = ready.stats
        self._codec = front_codec()
        self._batches: dict[int, tuple[list[NewRequest], asyncio.Future]] = {}
        self._lora_updates: dict[int, asyncio.Future] = {}  # UpdateLoRA's op_id -> its answer
        self._next_batch = 0
        self._reader: asyncio.Task | None = None
        self._exited = False
        self._stopping = False

    # ------------------------------------------------------------------ start-up (blocking)

    @classmethod
    def launch(cls, config: EngineConfig, *, load_tokenizer: Callable[[], Any], cpus: CpuSplit | None = None,
               publisher: PublisherSettings | None = None,
               kv_events: KVEventsConfig | None = None) -> EngineCoreClient:
        """Start the core and wait until it is ready; raises ValueError (a bad flag, a missing
        model) or RuntimeError (anything else) with the core's reason if it fails to start.
        ``load_tokenizer`` runs while the core imports torch and loads the model: the front end's
        own loading then costs no wall time where a second CPU is free (a cold start from zero)."""
        folder = tempfile.mkdtemp(prefix="kvscale-core-")
        context, to_core, from_core = bind_core_sockets(folder)
        settings = CoreSettings(config=config, input_address=f"ipc://{folder}/input",
                                output_address=f"ipc://{folder}/output",
                                cpus=cpus.core if cpus else None,
                                num_threads=core_threads(cpus, os.environ.get("OMP_NUM_THREADS")) if cpus else None,
                                publisher=publisher, kv_events=kv_events)
        # spawn: a fresh interpreter; a fork would inherit this process's threads and locks.
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(settings,), name="kvscale-engine-core", daemon=True)
        process.start()
        awaited = False
        try:
            tokenizer = load_tokenizer()
            awaited = True
            ready = cls._wait_ready(process, from_core)
        except BaseException:
            # A core that failed exits by itself; one still starting (the front end's own load
            # failed) has nothing to finish: it is ended at once.
            _end_process(process, 5.0 if awaited else 0.0)
            to_core.close()
            from_core.close()
            context.term()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if cpus is not None and cpus.front:
            os.sched_setaffinity(0, cpus.front)
        logger.info("engine core pid %d ready (warm-up %.2f s, %d start-up objects frozen out of the garbage "
                    "collector)", ready.pid, ready.warm_up_s, ready.frozen_objects)
        return cls(process, context, to_core, from_core, folder, ready, tokenizer)

    @staticmethod
    def _wait_ready(process: Any, from_core: zmq.Socket) -> Ready:
        codec = front_codec()
        while True:
            if from_core.poll(200):
                message = codec.decode(from_core.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, CoreFailed):
                    error = ValueError if message.kind == "invalid" else RuntimeError
                    raise error(message.reason)
                continue
            if not process.is_alive():
                raise RuntimeError(f"the engine core process {describe_exit(process.exitcode)} "
                                   "while starting")

    # ------------------------------------------------------------------ lifecycle (event loop)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = asyncio.ensure_future(self._read(zmq.asyncio.Socket.from_socket(self._from_core)))
        self._reader.add_done_callback(self._on_reader_done)
        self._loop.add_reader(self._process.sentinel, self._on_exit)

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if not self._exited:
            with contextlib.suppress(zmq.ZMQError):
                self._to_core.send(self._codec.encode(Shutdown()), zmq.NOBLOCK)
            await asyncio.to_thread(_end_process, self._process, STOP_TIMEOUT_S)
        if self._loop is not None:
            self._loop.remove_reader(self._process.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            # A reader that failed was reported when it ended (_on_reader_done).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._exited = True
        self._to_core.close()
        self._from_core.close()
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return not self._exited and self.error is None

    # ------------------------------------------------------------------ to the core

    def _submit(self, requests: list[NewRequest], accepted: asyncio.Future, tenant: str = "",
                lora_name: str = "", priority: int = 0) -> None:
        self._next_batch += 1
        self._batches[self._next_batch] = (requests, accepted)
        for request_id, _, params, _ in requests:
            self._text.add(request_id, params)
        self._send(AddRequests(self._next_batch, [NewRequestMsg(*request) for request in requests],
                               tenant=tenant, lora_name=lora_name, priority=priority))

    def _send_abort(self, request_id: str) -> None:
        self._text.forget(request_id)
        self._send(AbortRequests([request_id]))

    async def update_lora(self, name: str, path: str | None) -> tuple[str, str] | None:
        if not self.is_alive:
            return "internal", "the engine is not running"
        assert self._loop is not None
        self._next_batch += 1
        answer: asyncio.Future = self._loop.create_future()
        self._lora_updates[self._next_batch] = answer
        self._send(UpdateLoRA(self._next_batch, name, path))
        return await answer

    def _send(self, message: Any) -> None:
        try:
            # Never blocks the event loop: the core reads all the time, so the queue stays short.
            self._to_core.send(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail(EngineCoreDied(f"the engine core process takes no more messages ({exc})"))

    # ------------------------------------------------------------------ from the core

    async def _read(self, from_core: zmq.asyncio.Socket) -> None:
        while True:
            message = self._codec.decode(await from_core.recv())
            if isinstance(message, StepDone):
                ended = [output.request_id for output in message.outputs if self._text.apply(output)]
                self._on_step_done(message.outputs, message.stats)
                if ended:  # by a stop string: the core frees their blocks
                    self._send(AbortRequests(ended))
            elif isinstance(message, Accepted):
                self._on_batch(message)
            elif isinstance(message, LoRAUpdated):
                answer = self._lora_updates.pop(message.op_id, None)
                if answer is not None and not answer.done():
                    answer.set_result((message.error_kind, message.error or "") if message.error_kind else None)
            elif isinstance(message, CoreFailed):
                logger.error("the engine core process (pid %d) failed: %s", self.pid, message.reason)
                self._fail(EngineCoreDied(message.reason))

    def _on_reader_done(self, reader: asyncio.Task) -> None:
        if self._stopping or self._exited:
            return
        why = "was cancelled" if reader.cancelled() else f"failed: {reader.exception()!r}"
        logger.error("reading from the engine core process (pid %d) %s; %d open request(s) fail, "
                     "/health and new requests answer 503", self.pid, why, len(self._streams),
                     exc_info=None if reader.cancelled() else reader.exception())
        self._fail(EngineCoreDied(f"the front end stopped hearing from the engine core: reading {why}"))

    def _on_batch(self, message: Accepted) -> None:
        batch = self._batches.pop(message.batch_id, None)
        if batch is None:
            return
        requests, accepted = batch
        error: BaseException | None = None
        if message.error is not None:
            error = (ValueError if message.error_kind == "invalid" else RuntimeError)(message.error)
            for request in requests:
                self._text.forget(request[0])
        self._on_accepted(requests, accepted, error)

    def _on_exit(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._process.sentinel)
        self._process.join(1)
        how = describe_exit(self._process.exitcode)
        self._exited = True
        if self._stopping:
            return
        logger.error("the engine core process (pid %d) %s; %d open request(s) fail, /health and new "
                     "requests answer 503", self.pid, how, len(self._streams))
        self._fail(EngineCoreDied(f"the engine core process (pid {self.pid}) {how}"))

    def _fail(self, exc: BaseException) -> None:
        error = self._fail_all(exc)
        self._text.clear()
        batches, self._batches = self._batches, {}
        for _, accepted in batches.values():
            if not accepted.done():
                accepted.set_result(error)
        updates, self._lora_updates = self._lora_updates, {}
        for answer in updates.values():
            if not answer.done():
                answer.set_result(("internal", str(error)))


def _end_process(process: Any, timeout_s: float) -> None:
    """Wait for the process to exit; terminate it, then kill it, if it will not."""
    deadline = time.monotonic() + timeout_s
    process.join(max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
