"""The front end's view of the engine core's health (engine_core_client.py, engine_front.py):
its reading task ending marks the engine dead, and a core that stays silent past the step bound
while requests are open fails /health until it answers again.

The core here is the far end of the real ZMQ sockets, speaking the wire protocol from the test
(engine_core_wire.py), beside a real process whose death the front end would also watch: the
real core's own failures are tests/server/engine/test_engine_core.py's."""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
import time

import pytest
import zmq

from kvscale.server.engine.engine_core_client import EngineCoreClient, bind_core_sockets
from kvscale.server.engine.engine_core_wire import (
    Accepted,
    AddRequests,
    Ready,
    StepDone,
    core_codec,
)
from kvscale.server.engine.engine_front import stalled_for
from kvscale.server.outputs import EngineStats
from kvscale.server.sampling_params import SamplingParams

STATS = EngineStats(num_running=0, num_waiting=0, kv_blocks_total=8, kv_blocks_active=0,
                    kv_blocks_cached=0, block_size=16, prefix_cache_queries=0, prefix_cache_hits=0,
                    num_preemptions=0)


class FakeCore:
    """The core's end of the sockets: reads the front end's adds, answers what the test says."""

    def __init__(self, client: EngineCoreClient) -> None:
        folder = client._folder
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(f"ipc://{folder}/input")
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.connect(f"ipc://{folder}/output")
        self.codec = core_codec()
        time.sleep(0.2)  # ZMQ connects in the background: the front end's first add needs a peer

    def accept_next(self) -> None:
        assert self.inbox.poll(5000), "no add reached the core"
        message = self.codec.decode(self.inbox.recv())
        assert isinstance(message, AddRequests)
        self.outbox.send(self.codec.encode(Accepted(message.batch_id)))

    def step_done(self) -> None:
        self.outbox.send(self.codec.encode(StepDone([], STATS)))

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close(0)
        self.context.term()


@pytest.fixture
def client_and_core():
    folder = tempfile.mkdtemp(prefix="kvscale-core-test-")
    context, to_core, from_core = bind_core_sockets(folder)
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    ready = Ready(pid=process.pid, model_name="m", max_model_len=64, block_size=16, vocab_size=32,
                  num_blocks=8, stats=STATS, warm_up_s=0.0, frozen_objects=0)
    client = EngineCoreClient(process, context, to_core, from_core, folder, ready, tokenizer=None)
    core = FakeCore(client)
    yield client, core
    core.close()
    process.kill()
    process.join(5)


async def _stop(client: EngineCoreClient) -> None:
    """The process has no Shutdown to hear: it is killed, as the front end would after waiting."""
    client._process.kill()
    await client.stop()


async def _open_request(client: EngineCoreClient, core: FakeCore) -> None:
    adding = asyncio.ensure_future(client.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    await asyncio.sleep(0.05)
    core.accept_next()
    await asyncio.wait_for(adding, 5)


def test_a_core_silent_past_the_step_bound_fails_health_until_it_answers(client_and_core) -> None:
    client, core = client_and_core

    async def scenario() -> None:
        # A bound no pause of a busy test machine reaches between the core's answer and the check.
        client.step_timeout_s = 1.0
        client.start()
        await _open_request(client, core)
        assert client.health_problem() is None
        await asyncio.sleep(1.2)  # a step that does not end: heartbeats may flow, no StepDone
        problem = client.health_problem()
        assert problem is not None and "stuck" in problem and client.is_alive
        core.step_done()
        # The StepDone crosses ZMQ's I/O thread and the reader task, however long that takes here;
        # a front end that stayed "stuck" after it would stay so: the core sends nothing more.
        deadline = time.monotonic() + 5
        while client.health_problem() is not None:
            assert time.monotonic() < deadline, client.health_problem()
            await asyncio.sleep(0.01)
        await _stop(client)

    asyncio.run(scenario())


def test_the_reader_ending_marks_the_engine_dead(client_and_core) -> None:
    client, core = client_and_core

    async def scenario() -> None:
        client.start()
        await _open_request(client, core)
        stream = client._streams["r"]
        core.outbox.send(b"\xc1 not a message")  # what the reader cannot decode ends it
        with pytest.raises(Exception, match="stopped hearing from the engine core"):
            await asyncio.wait_for(stream.next(), 5)
        assert not client.is_alive
        assert "stopped hearing" in (client.health_problem() or "")
        await _stop(client)

    asyncio.run(scenario())


def test_silence_counts_only_with_work_and_past_the_bound() -> None:
    assert stalled_for(100.0, 10.0, busy=True, step_timeout_s=60.0) == 90.0
    assert stalled_for(100.0, 10.0, busy=False, step_timeout_s=60.0) is None
    assert stalled_for(100.0, 50.0, busy=True, step_timeout_s=60.0) is None
    assert stalled_for(100.0, 10.0, busy=True, step_timeout_s=None) is None
