"""W1 throughput: kvscale's engine against transformers `generate` in static batches.

Workload: N requests (64), prompt lengths uniform in [32, 512], output lengths uniform in
[16, 256], random token ids from a fixed seed, ignore_eos (every request generates exactly its
output length). kvscale gets all requests at once (continuous batching); the baseline runs them
in arrival order in static batches of 16, left-padded, each batch until its longest output.
Both sides: bundled model, same dtype, same torch thread count, each in its own process (so
each peak RSS is its own). Throughput counts only the requested output tokens.

    python -m bench.w1_throughput                  # full W1, writes bench/results/w1_throughput.json
    python -m bench.w1_throughput --num-requests 8 --max-output 32   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from bench.common import machine, peak_rss_bytes, run_side, write_result


def workload(args: argparse.Namespace, vocab_size: int = 49152) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(prompt_len)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return prompts, outputs


def side_kvscale(args: argparse.Namespace) -> dict:
    import torch

    from kvscale.server.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prompts, outputs = workload(args)
    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_bytes)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outputs), "kvscale generated a different number of tokens"
    ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
    stats = engine.get_stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "num_preemptions": stats.num_preemptions,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "kv_blocks": engine.num_blocks,
        "peak_rss_bytes": peak_rss_bytes(),
        "torch_threads": torch.get_num_threads(),
    }


def side_baseline(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvscale.server.model_loader import resolve_dtype, resolve_model_path

    torch.set_num_threads(args.threads)
    prompts, outputs = workload(args)
    path = resolve_model_path(None)
    dtype = resolve_dtype(args.dtype, AutoConfig.from_pretrained(str(path)), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run_batch(batch_prompts: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch_prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad)

    with torch.inference_mode():
        run_batch([prompts[0][:32]], 4)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            run_batch(prompts[i : i + args.batch_size], max(outputs[i : i + args.batch_size]))
        elapsed = time.perf_counter() - start
    useful = sum(outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "batch_size": args.batch_size,
        "peak_rss_bytes": peak_rss_bytes(),
        "torch_threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--batch-size", type=int, default=16, help="baseline static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--side", choices=["kvscale", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        result = side_kvscale(args) if args.side == "kvscale" else side_baseline(args)
        print(json.dumps(result))
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--skip-baseline",)]
    passthrough = [a for i, a in enumerate(passthrough) if a != "--out" and (i == 0 or passthrough[i - 1] != "--out")]
    info = machine()
    kvscale = run_side("bench.w1_throughput", "kvscale", passthrough)
    print(f"kvscale: {kvscale['output_tokens_per_s']:.1f} tok/s in {kvscale['elapsed_s']:.1f} s", file=sys.stderr)
    baseline = None if args.skip_baseline else run_side("bench.w1_throughput", "baseline", passthrough)
    result = {
        "benchmark": "w1_throughput",
        "date": time.strftime("%Y-%m-%d"),
        "machine": info,
        "workload": {k: getattr(args, k) for k in ("num_requests", "min_prompt", "max_prompt", "min_output",
                                                    "max_output", "seed", "dtype", "threads")},
        "kvscale": kvscale,
        "baseline_transformers_static_batches": baseline,
        "speedup": kvscale["output_tokens_per_s"] / baseline["output_tokens_per_s"] if baseline else None,
        "target_speedup": 3.0,
    }
    path = write_result("w1_throughput", result, args.out)
    if baseline:
        print(f"baseline: {baseline['output_tokens_per_s']:.1f} tok/s; speedup {result['speedup']:.2f}x",
              file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
