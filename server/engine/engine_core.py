"""The engine core process: owns the LLMEngine and only schedules and runs steps.

``run_engine_core`` is the process's entry point (started by engine_core_client.py with the
``spawn`` method, so no torch state or thread is inherited). In order, before it says ``Ready``:
pin itself to its CPUs and size the OpenMP pool to them (cpu_binding.py; before torch is imported,
so the pool is born that size), build the engine, warm it up (the C kernels are built or loaded
and a prefill, a mixed and a decode pass and the sampler run once, so a new replica's first
request does not pay for them after /health said ready), then start the KV event publisher, and
freeze what start-up built out of the garbage collector's full passes.

Three threads. The input thread receives and decodes messages into a queue (and, under priority
scheduling, tells a forward in flight of a more urgent arrival: server/core/step_interrupt.py);
the busy loop (the main thread) takes whatever arrived between two steps, adds and aborts, runs
one step, and queues its outputs and stats; the output thread encodes and sends them. Decoding
and encoding overlap the forward pass, which releases the GIL. An idle core blocks on the input
queue, waking at least once a second so the publisher's heartbeats carry fresh stats.

The core publishes KV events and heartbeats to Redis itself: events come from the block pool and
the resync snapshot must be read between two steps, both only here.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.engine.engine_core_wire import (
    AbortRequests,
    Accepted,
    AddRequests,
    CoreFailed,
    LoRAUpdated,
    Ready,
    Shutdown,
    StepDone,
    UpdateLoRA,
    core_codec,
)
from kvscale.server.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger("kvscale.engine_core")

# How long the last messages (outputs, a failure) may take to leave when the core exits.
SEND_LINGER_MS = 5000


@dataclass(frozen=True)
class PublisherSettings:
    redis_url: str
    replica_id: str
    model_name: str
    base_url: str


@dataclass(frozen=True)
class CoreSettings:
    """Everything the core process is started with (pickled by multiprocessing)."""

    config: EngineConfig
    input_address: str  # the front end pushes here
    output_address: str  # the core pushes here
    cpus: tuple[int, ...] | None  # None: no affinity
    num_threads: int | None = None  # None: torch's own thread count
    publisher: PublisherSettings | None = None
    kv_events: KVEventsConfig | None = None  # --kv-events-config (vLLM's format on ZMQ)


def failure_kind(exc: BaseException) -> str:
    """"invalid" for what a flag or a request got wrong, "internal" for the rest."""
    return "invalid" if isinstance(exc, ValueError | TypeError | OverflowError | FileNotFoundError) else "internal"


class Terminated(BaseException):
    """SIGTERM reached the core (its front end died): stop, saying goodbye to Redis."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def run_engine_core(settings: CoreSettings) -> None:
    """The process's main: never returns normally while the front end wants it."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s kvscale engine core: %(message)s")
    # Ctrl-C reaches the whole process group: the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvscale.processes import die_with_parent, freeze_startup_heap

    die_with_parent()  # SIGTERM if the front end dies without saying goodbye (SIGKILL, OOM)
    signal.signal(signal.SIGTERM, _terminated)
    if settings.cpus:
        os.sched_setaffinity(0, settings.cpus)

    import zmq

    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(settings.input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    outbox.connect(settings.output_address)
    codec = core_codec()
    try:
        engine, publisher, warm_up_s = _start(settings)
    except BaseException as exc:  # noqa: BLE001 - the front end must hear why, then we exit
        logger.exception("engine core failed to start")
        outbox.send(codec.encode(CoreFailed(f"{type(exc).__name__}: {exc}", failure_kind(exc))))
        outbox.close()
        context.term()
        raise SystemExit(1) from exc
    # torch, transformers, the model and the warm-up's leftovers: every full collection would
    # walk them between two steps (310 ms on an H200's host at 256 sequences, all of them stalled).
    frozen = freeze_startup_heap()
    outbox.send(codec.encode(Ready(
        pid=os.getpid(), model_name=engine.model_name, max_model_len=engine.max_model_len,
        block_size=engine.block_size, vocab_size=engine.vocab_size, num_blocks=engine.num_blocks,
        stats=engine.get_stats(), warm_up_s=warm_up_s, frozen_objects=frozen)))
    core = EngineCore(engine, publisher)
    code = core.run(inbox, outbox, codec)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    context.term()  # sends what is left (up to SEND_LINGER_MS); ends the input thread
    raise SystemExit(code)


def _start(settings: CoreSettings) -> tuple[Any, Any, float]:
    import torch

    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.engine.output_builder import OutputKind

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    logger.info("pid %d, CPUs %s, %d torch threads", os.getpid(),
                ",".join(map(str, sorted(os.sched_getaffinity(0)))), torch.get_num_threads())
    engine = LLMEngine(settings.config)
    engine.output_kind = OutputKind.DELTA  # the front end streams deltas
    engine.detokenize = False  # and makes their text (kvscale.server.engine.output_text)
    started = time.perf_counter()
    warm_up(engine)
    warm_up_s = time.perf_counter() - started
    logger.info("warmed up in %.2f s", warm_up_s)
    publisher: Any = None  # the Redis publisher, the vLLM-format one, or both (KVEventSinks)
    if settings.publisher is not None:
        from kvscale.server.engine.kv_publisher import KVEventPublisher

        p = settings.publisher
        publisher = KVEventPublisher(redis_url=p.redis_url, replica_id=p.replica_id,
                                     model_name=p.model_name, base_url=p.base_url,
                                     block_size=engine.block_size)
        publisher.start()
    if settings.kv_events is not None and settings.kv_events.publishes:
        # One event source, two sinks: the loop hands the pool's events to both (kv_events_vllm.py).
        from kvscale.server.engine.kv_events_vllm import KVEventSinks, VllmKVEventPublisher

        vllm_publisher = VllmKVEventPublisher(settings.kv_events)
        try:
            vllm_publisher.start()
        except BaseException:
            if publisher is not None:
                publisher.stop()
            raise
        publisher = KVEventSinks([publisher, vllm_publisher] if publisher is not None else [vllm_publisher])
    return engine, publisher, warm_up_s


def warm_up(engine: Any) -> None:
    """Build (or load) the kernels and run every path a first request takes, leaving no trace:
    the runner's prefill, mixed and decode passes on scratch blocks, then the sampler, greedy
    and random, with logprobs; and the grammar library's view of the tokenizer (~0.5 s), which
    the first constrained request would otherwise build while the batch decodes, holding the GIL
    (a 0.28 s gap in the streams of a compile storm's first round, docs/server.md "Measured and not kept")."""
    import torch

    from kvscale.server.sampling_params import SamplingParams
    from kvscale.server.worker.sampler import SamplingRow, make_generator

    engine.runner.warm_up()
    logits = torch.zeros(2, engine.vocab_size, dtype=torch.float32)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [0, 1], 1, make_generator(None, 0)),
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.9, top_k=8), [0, 1], 1, make_generator(0, 1)),
    ]
    engine.sampler(logits, rows)
    engine.structured.compiler.tokenizer()


class EngineCore:
    """The busy loop, and the threads that feed and drain it."""

    def __init__(self, engine: Any, publisher: Any = None) -> None:
        self.engine = engine
        self.publisher = publisher
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self, inbox: Any, outbox: Any, codec: Any) -> int:
        """Serve until Shutdown (0) or a failure (1, after telling the front end why)."""
        reader = threading.Thread(target=self._read, args=(inbox, codec), name="core-input", daemon=True)
        writer = threading.Thread(target=self._write, args=(outbox, codec), name="core-output", daemon=True)
        reader.start()
        writer.start()
        code = 0
        try:
            self._loop()
        except Terminated:
            logger.warning("SIGTERM: stopping")
        except BaseException as exc:  # noqa: BLE001 - any failure kills the core; report it
            logger.error("engine core died:\n%s", traceback.format_exc())
            self._outputs.put(CoreFailed(f"{type(exc).__name__}: {exc}", "internal"))
            code = 1
        finally:
            if self.publisher is not None:
                self.publisher.stop()
            self._outputs.put(None)
            writer.join(SEND_LINGER_MS / 1000)
        return code

    # ------------------------------------------------------------------ threads

    def _read(self, inbox: Any, codec: Any) -> None:
        import zmq

        interrupt = self.engine.step_interrupt
        try:
            while True:
                message = codec.decode(inbox.recv())
                if interrupt is not None and isinstance(message, AddRequests):
                    with interrupt.lock:  # the request and its note together (step_interrupt.py)
                        self._inputs.put(message)
                        interrupt.on_arrival(message.priority)
                else:
                    self._inputs.put(message)
        except zmq.ContextTerminated:
            inbox.close()

    def _write(self, outbox: Any, codec: Any) -> None:
        while (message := self._outputs.get()) is not None:
            outbox.send(codec.encode(message))
        outbox.close()

    # ------------------------------------------------------------------ the busy loop

    def _loop(self) -> None:
        from kvscale.server.engine.core_loop import add_all, step_and_publish, take_all
        from kvscale.server.engine.lora_updates import update_lora

        engine = self.engine
        interrupt = engine.step_interrupt
        last_publish = 0.0
        while True:
            messages = take_all(self._inputs, block=not engine.has_unfinished_requests())
            if interrupt is not None:
                with interrupt.lock:  # what was noted is taken now (step_interrupt.py)
                    messages += take_all(self._inputs, block=False)
                    interrupt.taken()
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AddRequests):
                    error = add_all(engine, [(r.request_id, r.prompt, r.params, r.cache_salt)
                                             for r in message.requests], message.tenant, message.lora_name,
                                    message.priority)
                    if error is None:
                        self._outputs.put(Accepted(message.batch_id))
                    else:
                        self._outputs.put(Accepted(message.batch_id, failure_kind(error), str(error)))
                elif isinstance(message, AbortRequests):
                    for request_id in message.request_ids:
                        engine.abort_request(request_id)
                elif isinstance(message, UpdateLoRA):
                    refused = update_lora(engine, message.name, message.path)
                    self._outputs.put(LoRAUpdated(message.op_id, *refused) if refused else LoRAUpdated(message.op_id))
            turn = step_and_publish(engine, self.publisher, had_input=bool(messages),
                                    last_publish=last_publish)
            if turn is None:
                continue
            last_publish = time.monotonic()
            self._outputs.put(StepDone(*turn))
