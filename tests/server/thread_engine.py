"""An LLMEngine driven on a thread of the test process, behind the same ``EngineFront`` the HTTP
side talks to: for tests that want the API over an in-process engine (no core process to
spawn). ``kvscale serve`` runs the engine in its own process (engine_core_client.py).

LLMEngine is not thread-safe, so exactly one thread (the engine thread) ever touches it. The event
loop talks to that thread through a thread-safe command queue (add, abort, stop).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscale.server.engine.core_loop import NewRequest, add_all, step_and_publish, take_all
from kvscale.server.engine.engine_front import EngineFront, RequestStream
from kvscale.server.engine.output_builder import OutputKind
from kvscale.server.outputs import EngineStats, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    """Requests admitted together (a list of prompts): the engine takes all of them in one go."""

    requests: list[NewRequest]
    accepted: asyncio.Future  # resolves to None, or to the exception add_request raised
    tenant: str = ""
    lora_name: str = ""  # "": the base model
    priority: int = 0


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass



class ThreadEngine(EngineFront):
    """Drives an LLMEngine on a thread of this process.

    ``publisher`` (KV events for the router) runs on the engine thread, since its ``on_step``
    needs the engine.
    """

    def __init__(
        self,
        engine: Any,
        *,
        publisher: Any = None,
        on_step: Callable[[list[RequestOutput], dict[str, RequestStream], EngineStats], None] | None = None,
        on_request_end: Callable[[RequestStream, str], None] | None = None,
    ) -> None:
        super().__init__(on_step=on_step, on_request_end=on_request_end)
        self.engine = engine
        engine.output_kind = OutputKind.DELTA  # the HTTP side streams deltas; it never needs the whole so far
        self.publisher = publisher
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle (event loop)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="kvscale-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, 30)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _submit(self, requests: list[NewRequest], accepted: asyncio.Future, tenant: str = "",
                lora_name: str = "", priority: int = 0) -> None:
        self._commands.put(_Add(requests, accepted, tenant, lora_name, priority))

    def _send_abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine; report it
            logger.exception("engine thread died")
            self.error = exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_thread, exc)
        finally:
            if self.publisher is not None:
                try:
                    self.publisher.stop()
                except Exception:  # noqa: BLE001
                    logger.exception("KV event publisher failed to stop")

    def _loop_forever(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None, "start() sets the loop before the thread runs"
        last_publish = 0.0
        while True:
            busy = engine.has_unfinished_requests()
            commands = take_all(self._commands, block=not busy)
            for command in commands:
                if isinstance(command, _Stop):
                    return
                if isinstance(command, _Add):
                    error = add_all(engine, command.requests, command.tenant, command.lora_name,
                                    command.priority)
                    loop.call_soon_threadsafe(self._on_accepted, command.requests, command.accepted, error)
                elif isinstance(command, _Abort):
                    engine.abort_request(command.request_id)
            turn = step_and_publish(engine, self.publisher, had_input=bool(commands),
                                    last_publish=last_publish)
            if turn is None:
                continue
            last_publish = time.monotonic()
            loop.call_soon_threadsafe(self._on_step_done, *turn)

    # ------------------------------------------------------------------ back on the event loop

    def _fail_thread(self, exc: BaseException) -> None:
        error = self._fail_all(exc)
        # Adds the thread never answered would otherwise wait forever.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add) and not command.accepted.done():
                command.accepted.set_result(error)
