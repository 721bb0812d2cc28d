"""OpenAI-API load generator: N concurrent streams against `kvscale serve`, against the offline
engine on the same workload in the same run.

Workload (W1-like): random token-id prompts and output lengths from a fixed seed, ignore_eos, so
both sides generate exactly the same number of tokens. Both sides are closed loops with the same
concurrency (a new request starts when one finishes), the same engine flags, the same machine.

Reported: output tokens/s for each side and their ratio (HTTP / offline), HTTP time to first
token and inter-token latency p50/p99 (ITL = gap between streamed chunks carrying tokens),
and the offline TTFT for comparison.

    python -m bench.http_load                               # 32 streams, W1 lengths scaled down
    python -m bench.http_load --requests 64 --prompt-len 32 512 --output-len 16 256   # full W1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import quantile
from kvscale.processes import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int, vocab_size: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_len))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99),
            "mean": statistics.fmean(values) if values else float("nan")}


# ----------------------------------------------------------------------------- offline


def load_offline_engine(engine_flags: dict):
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_flags))


def run_offline(engine, workload: Workload, concurrency: int, round_id: int) -> dict:
    from kvscale.server.sampling_params import SamplingParams

    # Warm-up (first-call allocations), as the server gets one before its measured run.
    engine.add_request("warmup", workload.prompts[0][:16], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    next_index = 0
    starts: dict[str, float] = {}
    ttfts: list[float] = []
    seen_first: set[str] = set()
    total_tokens = 0

    def submit() -> None:
        nonlocal next_index
        i = next_index
        next_index += 1
        params = SamplingParams(max_tokens=workload.output_lens[i], ignore_eos=True, temperature=1.0, seed=i)
        engine.add_request(f"r{i}-{round_id}", workload.prompts[i], params)
        starts[f"r{i}-{round_id}"] = time.perf_counter()

    start = time.perf_counter()
    while next_index < min(concurrency, len(workload.prompts)):
        submit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id not in seen_first and output.outputs[0].token_ids:
                seen_first.add(output.request_id)
                ttfts.append(now - starts[output.request_id])
            if output.finished:
                total_tokens += len(output.outputs[0].token_ids)
                if next_index < len(workload.prompts):
                    submit()
    elapsed = time.perf_counter() - start
    return {"output_tokens": total_tokens, "seconds": elapsed, "output_tokens_per_s": total_tokens / elapsed,
            "ttft_s": summary(ttfts)}


# ----------------------------------------------------------------------------- HTTP


def start_server(engine_flags: dict, port: int, threads: int) -> subprocess.Popen:
    flags = ["--max-model-len", str(engine_flags["max_model_len"]),
             "--max-num-seqs", str(engine_flags["max_num_seqs"]),
             "--block-size", str(engine_flags["block_size"])]
    if engine_flags.get("kv_cache_memory_bytes"):
        flags += ["--kv-cache-memory-bytes", str(engine_flags["kv_cache_memory_bytes"])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *flags],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


async def wait_healthy(base_url: str) -> None:
    import httpx

    deadline = time.monotonic() + 300
    async with httpx.AsyncClient() as http:
        while True:
            try:
                if (await http.get(f"{base_url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvscale serve did not start")
            await asyncio.sleep(0.5)


async def run_http(base_url: str, workload: Workload, concurrency: int) -> dict:
    import httpx
    import openai

    await wait_healthy(base_url)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)))
    model = (await client.models.list()).data[0].id
    # Warm-up request, then the measured run.
    await client.completions.create(model=model, prompt=workload.prompts[0][:16], max_tokens=2)

    ttfts: list[float] = []
    itls: list[float] = []
    total_tokens = 0
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal total_tokens
        async with semaphore:
            sent = time.perf_counter()
            last = None
            stream = await client.completions.create(
                model=model, prompt=workload.prompts[i], max_tokens=workload.output_lens[i],
                temperature=1.0, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    total_tokens += chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttfts.append(now - sent)
                    else:
                        itls.append(now - last)
                    last = now

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    elapsed = time.perf_counter() - start
    await client.close()
    return {"output_tokens": total_tokens, "seconds": elapsed, "output_tokens_per_s": total_tokens / elapsed,
            "ttft_s": summary(ttfts), "itl_s": summary(itls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="offline/HTTP pairs, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--output", default=str(RESULTS / "http_load.json"))
    args = parser.parse_args(argv)

    from kvscale.server.model_loader import load_tokenizer, resolve_model_path

    vocab_size = len(load_tokenizer(resolve_model_path(None)))
    engine_flags = {
        "max_model_len": args.max_model_len or args.prompt_len[1] + args.output_len[1] + 16,
        "max_num_seqs": max(args.concurrency, 1),
        "block_size": 16,
        "device": "cpu",
    }

    # Same thread count on both sides, pinned: on a shared 2-core machine OpenMP's default of
    # one thread per core collapses under contention, and differently in different processes.
    import torch

    torch.set_num_threads(args.threads)
    engine = load_offline_engine(engine_flags)
    port = free_port()
    proc = start_server(engine_flags, port, args.threads)
    rounds = []
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}"))
        # Alternate the two sides so load from other work on the machine hits both alike.
        for round_id in range(args.rounds):
            # Fresh prompts each round (same for both sides), so no round reuses another's cache.
            workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len),
                                     args.seed + round_id, vocab_size)
            print(f"round {round_id}: offline engine, {args.requests} requests, concurrency "
                  f"{args.concurrency} ...", flush=True)
            offline = run_offline(engine, workload, args.concurrency, round_id)
            print(f"  {offline['output_tokens_per_s']:.2f} output tok/s", flush=True)
            print(f"round {round_id}: HTTP, {args.concurrency} streams ...", flush=True)
            http = asyncio.run(run_http(f"http://127.0.0.1:{port}", workload, args.concurrency))
            print(f"  {http['output_tokens_per_s']:.2f} output tok/s", flush=True)
            if http["output_tokens"] != offline["output_tokens"]:
                raise RuntimeError(f"token counts differ: HTTP {http['output_tokens']} vs "
                                   f"offline {offline['output_tokens']}")
            rounds.append({"offline": offline, "http": http,
                           "ratio": http["output_tokens_per_s"] / offline["output_tokens_per_s"]})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    ratio = statistics.median(r["ratio"] for r in rounds)
    http_all = [r["http"] for r in rounds]
    result = {
        "benchmark": "http_load",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": "cpu",
                    "torch_threads": args.threads},
        "workload": {"requests": args.requests, "concurrency": args.concurrency,
                     "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
                     "seed": args.seed, "ignore_eos": True, "prompts": "random token ids"},
        "engine": engine_flags,
        "rounds": rounds,
        "http_over_offline_throughput_median": ratio,
        "offline_output_tokens_per_s_median": statistics.median(r["offline"]["output_tokens_per_s"] for r in rounds),
        "http_output_tokens_per_s_median": statistics.median(h["output_tokens_per_s"] for h in http_all),
        "http_ttft_p50_s_median": statistics.median(h["ttft_s"]["p50"] for h in http_all),
        "http_ttft_p99_s_median": statistics.median(h["ttft_s"]["p99"] for h in http_all),
        "http_itl_p50_s_median": statistics.median(h["itl_s"]["p50"] for h in http_all),
        "http_itl_p99_s_median": statistics.median(h["itl_s"]["p99"] for h in http_all),
        "target": 0.9,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_median")}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
