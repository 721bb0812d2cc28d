"""The engine's share of a high-priority request's time to first token under a low-priority flood,
without HTTP: where the end-to-end figure (bench.tenants --figures priority) spends the rest.

One engine (the bundled model, ``--scheduling-policy priority``, 4 batch slots), driven as the
engine core process drives it: a thread plays the core's input thread, queueing each probe and
noting its priority under the step interrupt's lock (server/core/step_interrupt.py), and the loop
takes what was queued under that lock before each step. Probes (priority 0, ~20-token prompts,
4 output tokens) arrive one at a time, 50–150 ms apart, first with nothing else running, then
beside a flood of low-priority requests (priority 1, the same shape) kept at ``--flood`` in the
engine. The figure: arrival to first token, p50 / p90, flooded ÷ alone, in the same run.

    /tmp/quiet python -m bench.priority_engine

Writes bench/results/priority_engine.json (command, machine with CPU model and ISA flags, figures).
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import threading
import time
from typing import Any

import torch

from bench.common import machine, write_result
from bench.roofline import cpu_isa
from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

PROBE, LOW = 0, 1


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


class Driver:
    """The engine core's loop and input thread, for one engine in this process."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        interrupt = engine.step_interrupt
        assert interrupt is not None, "priority scheduling on one CPU rank gives steps up"
        self.interrupt = interrupt
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.rng = random.Random(args.seed)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.lows = 0

    def prompt(self) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(self.rng.randrange(14, 22))]

    def probes(self, side: str) -> None:
        """The input thread's side: a probe every 50–150 ms, queued with its note."""
        for i in range(self.args.probes):
            time.sleep(self.rng.uniform(0.05, 0.15))
            request_id = f"{side}-probe-{i}"
            with self.interrupt.lock:
                self.arrived[request_id] = time.perf_counter()
                self.inbox.put((request_id, self.prompt()))
                self.interrupt.on_arrival(PROBE)

    def add_low(self) -> None:
        self.engine.add_request(f"low-{self.lows}", self.prompt(), self.params, priority=LOW)
        self.lows += 1

    def run(self, side: str, flood: int) -> dict[str, Any]:
        engine = self.engine
        for _ in range(flood):
            self.add_low()
        lows_before, interrupted_before = self.lows, self.interrupt.num_interrupted
        sender = threading.Thread(target=self.probes, args=(side,))
        started = time.perf_counter()
        sender.start()
        probes = lambda: [r for r in self.arrived if r.startswith(side)]  # noqa: E731
        while sender.is_alive() or any(r not in self.first for r in probes()):
            with self.interrupt.lock:
                while True:
                    try:
                        request_id, prompt = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    engine.add_request(request_id, prompt, self.params, priority=PROBE)
                self.interrupt.taken()
            if not engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for output in engine.step():
                if "-probe-" in output.request_id and output.request_id not in self.first:
                    self.first[output.request_id] = time.perf_counter()
                elif output.finished and output.request_id.startswith("low-") and flood:
                    self.add_low()
        wall = time.perf_counter() - started
        sender.join()
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        ttft = [self.first[r] - self.arrived[r] for r in probes()]
        return {"probes": len(ttft), "ttft_p50_ms": quantile(ttft, 0.5) * 1e3, "ttft_p90_ms": quantile(ttft, 0.9) * 1e3,
                "ttft_mean_ms": statistics.fmean(ttft) * 1e3, "low_requests_per_s": (self.lows - lows_before) / wall,
                "steps_given_up": self.interrupt.num_interrupted - interrupted_before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--flood", type=int, default=40, help="low-priority requests kept in the engine")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=None, dtype="auto", device="cpu", max_num_seqs=args.max_num_seqs,
                                    scheduling_policy="priority", kv_cache_memory_bytes=256 * 1024**2))
    driver = Driver(engine, args)
    alone = driver.run("alone", 0)
    flooded = driver.run("flooded", args.flood)
    ratio = flooded["ttft_p90_ms"] / alone["ttft_p90_ms"]
    result = {"benchmark": "priority_engine", "command": "python -m bench.priority_engine " + " ".join(sys.argv[1:]),
              "machine": {**machine(), **cpu_isa()}, "parameters": vars(args), "alone": alone, "flooded": flooded,
              "p90_ttft_ratio": ratio}
    path = write_result("priority_engine", result, args.out)
    print(f"alone p90 {alone['ttft_p90_ms']:.1f} ms, flooded p90 {flooded['ttft_p90_ms']:.1f} ms: {ratio:.2f}x "
          f"({flooded['steps_given_up']} steps given up); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
