"""The whole engine on a GPU, JSON out: greedy equality with transformers, W1 throughput against
transformers, the decode step against its bandwidth roofline, and the host KV tier's restore copies.

    python -m bench.gpu_engine                 # needs CUDA; writes bench/results/gpu_engine.json
    python -m bench.gpu_engine --device cpu --quick   # the same code paths on CPU, small

Every part has its baseline in the same run, on the same device:

1. Greedy equality: the bundled model (float32 and bfloat16), five prompts through ``LLM``
   (one batch, then a second call whose prompt repeats a first prompt: a prefix-cache hit),
   against transformers' ``generate`` one prompt at a time; tokens equal, or where the first
   difference is.
2. W1 (bench/w1_throughput.py's workload: 64 requests, prompts 32-512, outputs 16-256,
   ignore_eos) in bfloat16: kvscale all at once against transformers in static batches of 16;
   and a wider W1 (256 requests, kvscale ``max_num_seqs`` 256, transformers batches of 64).
3. Decode step: N sequences of a given context decoding together; wall time per step against
   the roofline (weights + KV bytes read + logits) at the card's datasheet bandwidth, timed once
   every sequence is decoding. The engine runs as its core does under ``kvscale serve``: outputs
   as deltas, no detokenization (the front end's work).
   ``--parts layer_ops``: W1 and the decode step with the Triton layer ops and with their
   PyTorch forms. ``--parts async``: greedy tokens, W1 and the decode step with async
   scheduling (server/core/async_scheduling.py) and with synchronous steps; ``async_steps``: W1 and
   the decode step only; ``async_decode``: the decode step only.
4. Decode CUDA graphs (server/worker/decode_graphs.py): greedy tokens with graphs against the same
   engine with ``enforce_eager``, W1 and the decode step both ways.
5. Host KV tier: promoting and demoting blocks through ``HostKVCache`` (the engine's code path),
   with the tier's slots in order and shuffled, every byte checked, against one contiguous
   pinned copy of the same bytes each way; and inside the engine, a step that promotes, demotes
   and writes into just-demoted blocks at once, every block's bytes checked.

Its parts: the token checks (bench.gpu_engine_equality), the timings (bench.gpu_engine_speed) and
the host KV tier (bench.gpu_engine_tier).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine, write_result
from bench.gpu_engine_equality import async_vs_sync, graphs_vs_eager, greedy_equality
from bench.gpu_engine_speed import decode_step, w1
from bench.gpu_engine_tier import host_tier, tier_in_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    parser.add_argument("--parts", default="equality,w1,decode,graphs,tier,tier_engine")
    parser.add_argument("--peak-gbps", type=float, default=None, help="default: the card's datasheet figure")
    parser.add_argument("--shapes", default="64x1024,256x1024,256x4096",
                        help="--parts layer_ops: the decode steps' sequences x context")
    parser.add_argument("--layer-ops-order", default="tfft",
                        help="--parts layer_ops: t (Triton layer ops) and f (PyTorch forms), in run order")
    parser.add_argument("--async-order", default="sasa",
                        help="--parts async: s (synchronous steps) and a (async scheduling), in run order")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from bench.gpu_kernels import peak_bandwidth_gbps
    from kvscale.model_files import resolve_model_path

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_engine: CUDA is not available here (use --device cpu for a smoke run)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_gbps or (peak_bandwidth_gbps(name) if device.type == "cuda" else None)
    parts = set(args.parts.split(","))
    path = resolve_model_path(args.model) if parts - {"tier"} else Path()
    report: dict[str, Any] = {"machine": machine(), "device": name, "peak_gbps": peak,
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    quick = args.quick

    failures: list[str] = []

    def emit(key: str, part: Callable[[], dict]) -> None:
        # One part failing (a first run on a new card) must not cost the others' figures.
        try:
            value = part()
        except Exception:
            value = {"error": traceback.format_exc()}
            failures.append(key)
        report.setdefault(key, []).append(value)
        print(key, json.dumps(value), flush=True)
        write_result("gpu_engine", report, args.out)  # partial results survive a timeout

    if "equality" in parts:
        for dtype in ("float32", "bfloat16"):
            emit("greedy_equality", lambda dtype=dtype: greedy_equality(path, dtype, device, 8 if quick else 32))
    if "w1" in parts:
        emit("w1", lambda: w1(path, device, 8 if quick else 64, 64, 16))
        if not quick:
            emit("w1", lambda: w1(path, device, 256, 256, 64))
    if "decode" in parts:
        for num_seqs, context in ([(4, 64)] if quick else [(1, 512), (64, 1024), (256, 1024), (64, 4096)]):
            emit("decode_step", lambda n=num_seqs, c=context: decode_step(path, device, n, c, 8 if quick else 32, peak))
    if "graphs" in parts or "graphs_equality" in parts:
        for dtype in ("float32", "bfloat16"):
            emit("graphs_vs_eager", lambda dtype=dtype: graphs_vs_eager(path, dtype, device, 8 if quick else 32))
    if "graphs" in parts:
        emit("w1", lambda: w1(path, device, 8 if quick else 64, 64, None, enforce_eager=True))
        emit("w1", lambda: w1(path, device, 8 if quick else 64, 64, None))
        for num_seqs, context in ([(4, 64)] if quick else [(1, 512), (64, 1024), (256, 1024), (64, 4096)]):
            for eager in (True, False):
                emit("decode_step", lambda n=num_seqs, c=context, e=eager: decode_step(
                    path, device, n, c, 8 if quick else 32, peak, enforce_eager=e))
    if "layer_ops" in parts:
        # The Triton layer ops against their PyTorch forms, same engine, decode graphs on.
        # The first run in a process also pays Triton's compiles: one untimed W1 first.
        w1(path, device, 8, 64, None)
        order = [flag == "t" for flag in args.layer_ops_order]
        for fused in order:  # W1, 64 and 256 requests, decode graphs on
            emit("w1", lambda f=fused: w1(path, device, 8 if quick else 64, 64, None, triton_layer_ops=f))
            if not quick:
                emit("w1", lambda f=fused: w1(path, device, 256, 256, None, triton_layer_ops=f))
        shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
        for num_seqs, context in ([(4, 64)] if quick else shapes):
            for fused in order:
                emit("decode_step", lambda n=num_seqs, c=context, f=fused: decode_step(
                    path, device, n, c, 8 if quick else 32, peak, triton_layer_ops=f))
    if "async" in parts or "async_steps" in parts or "async_decode" in parts:
        # Async scheduling against synchronous steps, same engine, decode graphs and Triton layer
        # ops on; one untimed W1 first takes Triton's compiles. "async_steps": the timings alone
        # (runs of two checkouts alternating in one call, each equal-checked once).
        if "async" in parts:
            for dtype in ("float32", "bfloat16"):
                emit("async_vs_sync", lambda dtype=dtype: async_vs_sync(path, dtype, device, 8 if quick else 32))
        w1(path, device, 8, 64, None)
        order = [flag == "a" for flag in args.async_order]
        shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
        for overlapped in order:
            if "async_decode" not in parts:
                emit("w1", lambda o=overlapped: w1(path, device, 8 if quick else 64, 64, None, async_scheduling=o))
                if not quick:
                    emit("w1", lambda o=overlapped: w1(path, device, 256, 256, None, async_scheduling=o))
            for num_seqs, context in ([(4, 64)] if quick else shapes):
                emit("decode_step", lambda n=num_seqs, c=context, o=overlapped: decode_step(
                    path, device, n, c, 8 if quick else 32, peak, async_scheduling=o))
    if "tier" in parts:
        emit("host_tier", lambda: host_tier(device, 32 if quick else 1024, 3 if quick else 10))
    if "tier_engine" in parts:
        emit("tier_in_engine", lambda: tier_in_engine(path, device))
    print("wrote", write_result("gpu_engine", report, args.out))
    if failures:
        print("failed parts:", ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
