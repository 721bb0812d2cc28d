"""W2 shared prefix: mean time to first token and throughput with prefix caching on vs off.

Workload: N requests (32), each a shared 1024-token prefix followed by 64 unique tokens,
32 output tokens each (ignore_eos), random token ids from a fixed seed, all submitted at once.
The same engine settings run twice, each in its own process: --enable-prefix-caching on and off.
TTFT = first token time - arrival (time.monotonic), per request, averaged.

    python -m bench.w2_prefix              # writes bench/results/w2_prefix.json
    python -m bench.w2_prefix --baselines ''   # without vLLM
    python -m bench.w2_prefix --dtype auto     # each engine's own default precision (recorded per side)

Baseline in the same run (default): vLLM's CPU build with prefix caching on, the same requests
through its offline ``LLM`` (bench/anchors/vllm_cpu.py), same threads, batch limits and KV budget;
the figure to compare is mean TTFT, kvscale (caching on) against vLLM.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from bench.common import machine, peak_rss_bytes, run_side, write_result
from bench.roofline import cpu_isa, memory_stream


def workload(args: argparse.Namespace, vocab_size: int = 49152) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(args.prefix_len)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(args.unique_len)]
            for _ in range(args.num_requests)]


def side(args: argparse.Namespace, caching: bool) -> dict:
    import torch

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prompts = workload(args)
    llm = LLM(dtype=args.dtype, device="cpu", enable_prefix_caching=caching,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_bytes)
    engine = llm.llm_engine
    # Warm-up on unrelated tokens (nothing of the workload gets cached).
    llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=2, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    stats = engine.get_stats()
    return {
        "enable_prefix_caching": caching,
        "elapsed_s": elapsed,
        "mean_ttft_s": statistics.fmean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "max_ttft_s": max(ttfts),
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "prefix_cache_queries_tokens": stats.prefix_cache_queries,
        "prefix_cache_hits_tokens": stats.prefix_cache_hits,
        "cached_tokens_per_request_mean": statistics.fmean(r.num_cached_tokens for r in results),
        "kv_cache_bytes": engine.kv_cache_bytes,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "peak_rss_bytes": peak_rss_bytes(),
        "torch_threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--unique-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="both engines' --dtype; auto: each engine's own default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--baselines", default="vllm", help="'vllm' or '' (none)")
    parser.add_argument("--side", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        print(json.dumps(side(args, caching=args.side == "on")))
        return 0
    raw = list(argv if argv is not None else sys.argv[1:])
    drop = ("--out", "--baselines")
    passthrough = [a for i, a in enumerate(raw) if a not in drop and (i == 0 or raw[i - 1] not in drop)]
    info = machine()
    info["isa"] = cpu_isa()
    info["memory_stream_before"] = memory_stream(args.threads)
    on = run_side("bench.w2_prefix", "on", passthrough)
    off = run_side("bench.w2_prefix", "off", passthrough)
    vllm = None
    if "vllm" in args.baselines.split(","):
        from bench.anchors.vllm_cpu import run_offline

        prompts = workload(args)
        vllm = run_offline(prompts, [args.output_len] * len(prompts), threads=args.threads, dtype=args.dtype,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_gib=max(1, args.kv_cache_bytes // 1024**3), enable_prefix_caching=True)
        vllm.pop("log_tail", None)
        ttfts = vllm.pop("ttfts_s")
        vllm["median_ttft_s"] = statistics.median(ttfts) if ttfts else None
    info["memory_stream_after"] = memory_stream(args.threads)
    result = {
        "benchmark": "w2_prefix",
        "date": time.strftime("%Y-%m-%d"),
        "machine": info,
        "workload": {k: getattr(args, k) for k in ("num_requests", "prefix_len", "unique_len", "output_len",
                                                    "seed", "dtype", "threads")},
        "prefix_caching_on": on,
        "prefix_caching_off": off,
        "baseline_vllm_cpu_prefix_caching": vllm,
        "mean_ttft_kvscale_over_vllm": on["mean_ttft_s"] / vllm["mean_ttft_s"] if vllm else None,
        "target_mean_ttft_kvscale_over_vllm": 1.0,
        "mean_ttft_ratio_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        "throughput_ratio_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "target_mean_ttft_ratio": 5.0,
    }
    path = write_result("w2_prefix", result, args.out)
    if vllm:
        print(f"vLLM mean TTFT {vllm['mean_ttft_s']:.2f} s; kvscale / vLLM {result['mean_ttft_kvscale_over_vllm']:.2f}",
              file=sys.stderr)
    print(f"mean TTFT on {on['mean_ttft_s']:.2f} s, off {off['mean_ttft_s']:.2f} s: "
          f"{result['mean_ttft_ratio_off_over_on']:.1f}x; throughput {result['throughput_ratio_on_over_off']:.1f}x",
          file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
