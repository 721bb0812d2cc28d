"""The hostile soak's attackers in a process of their own (bench/hostile_process.py), paced, and
the soak's breakdown (bench/soak_breakdown.py): each process's CPU counted once, the honest TTFT
split by the bomb in flight.

A small real HTTP server on loopback stands for the routers: it refuses every request from its
head, as a router refuses an oversized upload.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import psutil

from bench.hostile_clients import CONCURRENCY, DISCONNECT_EVERY_S, PAUSE_S, pacing
from bench.hostile_process import HostileProcess, HostileSettings, grace_left
from bench.soak_breakdown import cpu_seconds, ttft_by_bomb, ttft_by_spans
from bench.soak_client import Outcome

REFUSAL = (b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
           b"content-length: 2\r\nconnection: close\r\n\r\n{}")
RUN_S = 2.0


class RefusingServer:
    """Answers 413 to every request as soon as its head has arrived, in a thread of its own."""

    def __init__(self) -> None:
        self.requests = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RefusingServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            writer.write(REFUSAL)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


def test_the_attackers_run_in_their_own_process_and_their_counts_come_back() -> None:
    with RefusingServer() as server:
        url = f"http://127.0.0.1:{server.port}"
        hostile = HostileProcess(HostileSettings([url, url], "sk-test", 4, bomb_deadline_s=5, grace_s=1))
        pid = hostile.start()
        # A child of this process, not a task on its loop: the honest clients' loop is theirs.
        assert pid != os.getpid() and psutil.Process(pid).ppid() == os.getpid()
        time.sleep(RUN_S)
        stats = hostile.stop_and_collect()
    assert stats.loop_errors == []
    counts = stats.as_dict()["sent"]
    assert counts["oversized"] and counts["unauthenticated"] and counts["over_logit_bias"]
    assert set(stats.statuses["oversized"]) == {413}


def test_oversized_uploads_and_abandoned_streams_are_paced_at_the_rates_the_report_states() -> None:
    # Refused at once, an unpaced client opened a connection as fast as the loop let it (170,541
    # uploads in a 245 s run); paced, at most one per PAUSE_S per client. Abandoned streams back
    # to back followed the replicas' speed; paced, at most one per DISCONNECT_EVERY_S per client.
    with RefusingServer() as server:
        url = f"http://127.0.0.1:{server.port}"
        hostile = HostileProcess(HostileSettings([url, url], "sk-test", 4, bomb_deadline_s=5, grace_s=1))
        hostile.start()
        started = time.monotonic()
        # The attackers' process is spawned (a fresh interpreter importing the bench): on a loaded
        # host it can take seconds before its first request, which a fixed window missed.
        while server.requests == 0:
            assert time.monotonic() - started < 60, "the attackers never sent a request"
            time.sleep(0.05)
        time.sleep(RUN_S)
        stats = hostile.stop_and_collect()
        ran_s = time.monotonic() - started
    for kind, rate in (("oversized", pacing()["oversized_uploads_per_s_max"]),
                       ("disconnect", pacing()["abandoned_streams_per_s_max"])):
        assert 0 < sum(stats.statuses[kind].values()) <= rate * ran_s + CONCURRENCY[kind], kind
    assert pacing()["oversized_uploads_per_s_max"] == CONCURRENCY["oversized"] / PAUSE_S
    assert pacing()["abandoned_streams_per_s_max"] == CONCURRENCY["disconnect"] / DISCONNECT_EVERY_S


def test_a_bomb_in_flight_at_the_stop_gets_its_deadline_not_just_the_grace() -> None:
    settings = HostileSettings([], None, 4, bomb_deadline_s=300, grace_s=10)
    assert grace_left(settings, None, now=1000.0) == 10
    assert grace_left(settings, 990.0, now=1000.0) == 291  # sent 10 s ago: 290 s left, and 1
    assert grace_left(settings, 600.0, now=1000.0) == 10  # past its deadline: the grace


def test_the_soak_client_is_counted_without_the_platform_it_started() -> None:
    # The soak's children are the platform's processes, each counted under its own name: counted
    # with its children too, the soak client's cores were the whole platform's.
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"])
    try:
        child = psutil.Process(burner.pid)
        deadline = time.monotonic() + 20
        while sum(child.cpu_times()[:2]) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = {"soak_client": os.getpid(), "replica": burner.pid}
        own = cpu_seconds(pids)
        with_children = cpu_seconds(pids, own_only=frozenset())
    finally:
        burner.kill()
        burner.wait()
    assert own["replica"] >= 0.6
    assert with_children["soak_client"] - own["soak_client"] >= 0.5
    # The host's own counters beside them: at least what the burner took.
    assert own["host_busy"] >= own["replica"] and own["host_steal"] >= 0


def test_honest_ttft_is_split_by_the_bomb_in_flight_and_its_replica() -> None:
    def honest(started: float, replica: str | None, ttft: float, hung_up: bool = False) -> Outcome:
        return Outcome(0, started, replica=replica, first_chunk_s=ttft, hung_up=hung_up)

    spans = [(10.0, 20.0, "r1"), (30.0, 40.0, None)]
    split = ttft_by_bomb([honest(5, "r1", 0.1), honest(12, "r1", 3.0), honest(15, "r2", 0.5),
                          honest(35, "r1", 0.7), honest(16, "r1", 9.0, hung_up=True)], spans)
    assert {side: (v["requests"], v["ttft_p90_s"]) for side, v in split.items()} == {
        "no_bomb": (1, 0.1), "bomb_on_same_replica": (1, 3.0), "bomb_on_another_replica": (2, 0.7)}


def test_honest_ttft_is_split_by_any_kind_of_hostile_request_in_flight() -> None:
    honest = [Outcome(0, 12.0, replica="r2", first_chunk_s=2.0), Outcome(0, 50.0, replica="r1", first_chunk_s=0.2)]
    split = ttft_by_spans(honest, [(11.0, 13.0, "r2")], "slow_schema")
    assert {side: v["requests"] for side, v in split.items()} == {
        "no_slow_schema": 1, "slow_schema_on_another_replica": 0, "slow_schema_on_same_replica": 1}
