"""Calibration of the autoscaling replay on one real replica (`bench.autoscale_replay
--calibrate`): a `kvscale serve` of the bundled model, its cold start, KV pool, prefill rate,
decode step by batch, and what sharing the host's cores costs (`autoscale_sim.SharedHost`); and
the loaders that turn the written JSON back into the simulator's `Calibration` and `SharedHost`."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.autoscale_sim import (
    Calibration,
    SharedHost,
    contention_exponent,
    host_slowdown,
    start_pressure,
)
from bench.autoscale_workloads import BLOCK
from bench.common import REPO, RESULTS

CALIBRATION = RESULTS / "autoscale_calibration.json"


ENGINE_FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                "--block-size", str(BLOCK)]


class ServeProcess:
    """One `kvscale serve` of the bundled model with the calibration's flags, and its CPU time."""

    def __init__(self) -> None:
        import psutil

        from kvscale.processes import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1",
                                      "--port", self.url.rsplit(":", 1)[1], *ENGINE_FLAGS],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        self.process = psutil.Process(self.proc.pid)

    def cpu_seconds(self) -> float:
        """CPU time of the process and its children (the engine core, a kernel's compiler)."""
        import psutil

        total = 0.0
        for p in [self.process, *self.process.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def wait_ready(self) -> float:
        """Seconds from process start to /health 200."""
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise SystemExit("kvscale serve exited during calibration")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def timed(client, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, total time) of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json={
            "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


def decode_step(client, seed: int) -> float:
    """One 64-token answer's time per token after its first."""
    ttft, total = timed(client, [5 + seed, 6, 7, 8], 64)
    return (total - ttft) / 63


DECODE_BATCHES = (4, 8, 16)  # up to the calibration's --max-num-seqs


def concurrent_decode_steps(client, batch: int, seed: int) -> list[float]:
    """Each of ``batch`` streams' time per token after its first, all decoding at once: a decode
    step at that batch size."""
    import threading

    steps: list[float] = []
    threads = [threading.Thread(target=lambda s=seed + i: steps.append(decode_step(client, s)))
               for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return steps


def per_sequence_slope(by_batch: dict[int, float]) -> float:
    """What each sequence beyond the first adds to a decode step: the least-squares slope through
    the batch-1 step (`Calibration.decode_step_per_seq_s`), never below 0."""
    one = by_batch[1]
    points = [(batch - 1, step - one) for batch, step in by_batch.items() if batch > 1]
    if not points:
        return 0.0
    return max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))


def calibrate() -> dict:
    """One replica alone (cold start, KV pool, prefill, decode), then what sharing this host's
    cores costs (see `autoscale_sim.SharedHost`): the CPU a replica uses starting and stepping,
    its decode steps while a second replica starts, and two replicas decoding at once."""
    import threading

    import httpx

    first = ServeProcess()
    second: ServeProcess | None = None
    try:
        cold_start = first.wait_ready()
        start_cores = first.cpu_seconds() / cold_start
        metrics = httpx.get(first.url + "/metrics", timeout=5).text
        kv_blocks = int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith("kvscale:kv_blocks_total")))
        client = httpx.Client(base_url=first.url, timeout=120)
        prompt_ids = [random.Random(i).randrange(1000, 20000) for i in range(480)]
        timed(client, prompt_ids[:16], 2)  # anything left to warm
        prefill, decode, busy = [], [], []
        for run in range(3):
            fresh = [(t + 7919 * (run + 1)) % 30000 + 100 for t in prompt_ids]  # no cache hit
            ttft, _ = timed(client, fresh, 1)
            prefill.append(len(fresh) / ttft)
            cpu, wall = first.cpu_seconds(), time.perf_counter()
            decode.append(decode_step(client, run))
            busy.append((first.cpu_seconds() - cpu) / (time.perf_counter() - wall))
        step = statistics.median(decode)
        by_batch = {1: step}
        for batch in DECODE_BATCHES:
            by_batch[batch] = statistics.median(concurrent_decode_steps(client, batch, seed=100 * batch))
        # A second replica starts while the first decodes without a pause.
        during_start: list[float] = []
        second = ServeProcess()
        done = threading.Event()

        def keep_decoding() -> None:
            seed = 10
            while not done.is_set():
                during_start.append(decode_step(client, seed))
                seed += 1

        worker = threading.Thread(target=keep_decoding)
        worker.start()
        second_cold = second.wait_ready()
        second_start_cores = second.cpu_seconds() / second_cold
        done.set()
        worker.join()
        # Both replicas decode at once.
        other = httpx.Client(base_url=second.url, timeout=120)
        timed(other, prompt_ids[:16], 2)
        both: list[float] = []
        for run in range(3):
            threads = [threading.Thread(target=lambda c=c, s=run: both.append(decode_step(c, 20 + s)))
                       for c in (client, other)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        cores = float(os.cpu_count() or 1)
        busy_cores = statistics.median(busy)
        two_busy = statistics.median(both) / step
        host = SharedHost(cores=cores, busy_cores=busy_cores, start_cores=start_cores,
                          exponent=contention_exponent(cores, busy_cores, two_busy))
        shared = {**asdict(host), "two_busy_slowdown": two_busy,
                  # A check of the model on a case it was not fitted to: a step while a replica starts.
                  "slowdown_during_start": (statistics.median(during_start) / step
                                            if during_start else None),
                  "predicted_slowdown_during_start": host_slowdown(host, 1, 1),
                  "second_cold_start_s": second_cold, "second_start_cores": second_start_cores,
                  "runs": {"busy_cores": busy, "during_start": during_start, "both": both}}
        return {"cold_start_s": cold_start, "kv_blocks": kv_blocks,
                "prefill_tokens_per_s": statistics.median(prefill),
                "decode_step_s": step, "decode_step_per_seq_s": per_sequence_slope(by_batch),
                "decode_step_s_by_batch": by_batch,
                "runs": {"prefill": prefill, "decode": decode},
                "engine_flags": ENGINE_FLAGS, "shared_host": shared}
    finally:
        first.stop()
        if second is not None:
            second.stop()


def load_shared_host(path: Path, background_cores: float = 0.0) -> SharedHost:
    """The calibration's shared-host figures (older calibration files have none)."""
    data = json.loads(path.read_text())["calibration"].get("shared_host")
    if data is None:
        raise SystemExit(f"{path} has no shared_host figures: recalibrate (--calibrate --calibration NEW)")
    host = SharedHost(cores=data["cores"], busy_cores=data["busy_cores"],
                      start_cores=data["start_cores"], background_cores=background_cores,
                      exponent=data["exponent"])
    if data.get("slowdown_during_start"):  # what a cold start really cost the stepping replica
        host = replace(host, start_pressure_cores=start_pressure(
            replace(host, background_cores=0.0), data["slowdown_during_start"]))
    return host


def load_calibration(path: Path) -> Calibration:
    data = json.loads(path.read_text())["calibration"]
    return Calibration(prefill_tokens_per_s=data["prefill_tokens_per_s"],
                       decode_step_s=data["decode_step_s"], kv_blocks=data["kv_blocks"],
                       block_size=BLOCK, max_num_seqs=16, step_tokens=512,
                       cold_start_s=data["cold_start_s"],
                       decode_step_per_seq_s=data.get("decode_step_per_seq_s", 0.0))
