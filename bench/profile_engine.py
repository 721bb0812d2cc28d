"""Where an engine step's time goes: scheduling, input preparation, the forward pass per op
(GEMMs, attention, KV writes, norms...), sampling and the rest of the step (Python around it).

Runs a W1-shaped workload (random token ids, ignore_eos, greedy) through ``LLMEngine`` in this
process, timing each phase of every step with wrappers, and the forward pass's ops with
``torch.profiler`` over a few steps of each kind (prefill-bearing and pure decode). The C kernels
(attention, KV writes, the layer ops, kvscale's own projections) are calls through ctypes that
torch.profiler does not see, so every step's forward is also split by wrappers around the kernel
backend's ops, the layer ops and each projection module (``forward_ops_s``).

    python -m bench.profile_engine --threads 2           # writes bench/results/profile_engine.json
    python -m bench.profile_engine --num-requests 16 --max-output 32   # a quick look
    python -m bench.profile_engine --dtype bfloat16 --prefill-attention sdpa   # without the C prefill kernel
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from typing import Any

from bench.common import machine, write_result
from bench.w1_throughput import add_workload_args, workload


def _wrap(obj: Any, name: str, bucket: str, totals: dict[str, float]) -> None:
    setattr(obj, name, _timed(getattr(obj, name), bucket, totals))


def _timed(inner: Any, bucket: str, totals: dict[str, float]) -> Any:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[bucket] += time.perf_counter() - start

    return timed


def _wrap_forward_ops(runner: Any, totals: dict[str, float]) -> None:
    """Time the forward's parts into ``totals``: the kernel backend's ops, the layer ops, and each
    projection module (the outermost of nested ones, so none counts twice)."""
    import dataclasses

    from torch import nn

    from kvscale.kernels import cpu_native, layer_ops
    from kvscale.server.worker.cpu_linear import PackedLinear
    from kvscale.server.worker.quantization import Int8Linear

    runner.kernels = dataclasses.replace(
        runner.kernels,
        write_kv=_timed(runner.kernels.write_kv, "kv_write", totals),
        paged_decode_attention=_timed(runner.kernels.paged_decode_attention, "decode_attention", totals),
        paged_prefill_attention=_timed(runner.kernels.paged_prefill_attention, "prefill_attention", totals))
    for name in ("add_rms_norm", "rope", "silu_and_mul"):
        setattr(layer_ops, name, _timed(getattr(layer_ops, name), name, totals))
    # A batched step's layers in one C call (server/worker/cpu_step_layers.py): one bucket, since
    # the ops inside it are not separate calls any more.
    cpu_native.step_layers = _timed(cpu_native.step_layers, "step_layers_one_call", totals)
    wrapped: list[str] = []
    for name, module in runner.model.named_modules():
        if any(name.startswith(outer + ".") for outer in wrapped):
            continue
        if isinstance(module, nn.Linear | PackedLinear | Int8Linear):  # RowKernelLinear is a PackedLinear
            module.forward = _timed(module.forward, "projections", totals)
            # A gate|up that applies SiLU-and-multiply as it stores (AMX, decode's rows): a
            # projection with a longer epilogue, counted as one.
            if hasattr(module, "silu_and_mul"):
                module.silu_and_mul = _timed(module.silu_and_mul, "projections", totals)
            wrapped.append(name)


def _op_table(prof, top: int) -> list[dict[str, Any]]:
    rows = []
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append({"op": event.key, "calls": event.count, "self_ms": event.self_cpu_time_total / 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps of each kind under torch.profiler")
    parser.add_argument("--prefill-attention", choices=["auto", "sdpa"], default="auto",
                        help="sdpa: the PyTorch reference even where a C kernel (AMX for bfloat16, AVX2 "
                             "for float32) would run, for a before/after of that kernel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    if args.prefill_attention == "sdpa":
        from kvscale.kernels import cpu_attention

        # paged_prefill_attention asks cpu_attention's own names, so those are the ones to replace.
        cpu_attention.amx_prefill_available = lambda: False  # type: ignore[method-assign]
        cpu_attention.f32_prefill_available = lambda: False  # type: ignore[method-assign]
    prompts, outputs = workload(args)
    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))

    totals: dict[str, float] = collections.defaultdict(float)
    _wrap(engine.scheduler, "schedule", "schedule", totals)
    _wrap(engine.runner, "prepare", "prepare_inputs", totals)
    _wrap(engine.runner.model, "hidden_states", "forward", totals)
    _wrap(engine.runner.model, "compute_logits", "logits", totals)
    forward_ops: dict[str, float] = collections.defaultdict(float)
    _wrap_forward_ops(engine.runner, forward_ops)
    _wrap(engine, "sampler", "sample", totals)
    _wrap(engine, "_append_token", "append_token_detokenize", totals)

    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    kinds = {"prefill": [], "decode": []}
    step_times: dict[str, list[float]] = {"prefill": [], "decode": []}
    tables: dict[str, Any] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        sched_peek = engine.scheduler
        is_decode = bool(sched_peek.running) and not sched_peek.waiting and all(
            s.num_computed_tokens >= s.num_tokens - 1 for s in sched_peek.running)
        kind = "decode" if is_decode else "prefill"
        t0 = time.perf_counter()
        if len(kinds[kind]) < args.profile_steps and (kind == "prefill" or len(sched_peek.running) >= 8):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            kinds[kind].append(prof)
        else:
            engine.step()
        step_times[kind].append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    for kind, profs in kinds.items():
        merged: dict[str, dict[str, float]] = {}
        for prof in profs:
            for row in _op_table(prof, 40):
                entry = merged.setdefault(row["op"], {"calls": 0, "self_ms": 0.0})
                entry["calls"] += row["calls"]
                entry["self_ms"] += row["self_ms"]
        steps = max(1, len(profs))
        tables[kind] = sorted(
            ({"op": op, "calls_per_step": v["calls"] / steps, "self_ms_per_step": v["self_ms"] / steps}
             for op, v in merged.items()), key=lambda r: -r["self_ms_per_step"])[:25]
    phases = dict(totals)
    phases["step_total"] = elapsed
    phases["other_step_python"] = elapsed - sum(totals.values())  # engine.step around the phases
    # The LM head is a projection inside compute_logits, not the hidden states' forward.
    forward_split = dict(forward_ops)
    forward_split["forward_other"] = totals["forward"] + totals["logits"] - sum(forward_ops.values())
    result = {
        "benchmark": "profile_engine",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "args": vars(args),
        "output_tokens": sum(outputs),
        "output_tokens_per_s": sum(outputs) / elapsed,
        "phases_s": phases,
        "forward_ops_s": forward_split,
        "steps": {k: {"count": len(v), "median_s": sorted(v)[len(v) // 2] if v else None} for k, v in step_times.items()},
        "ops_per_profiled_step": tables,
    }
    path = write_result("profile_engine", result, args.out)
    print(json.dumps({k: result[k] for k in ("output_tokens_per_s", "phases_s", "forward_ops_s", "steps")}, indent=1),
          file=sys.stderr)
    for kind, rows in tables.items():
        print(f"--- {kind} (per profiled step)", file=sys.stderr)
        for r in rows[:18]:
            print(f"{r['self_ms_per_step']:9.1f} ms  {r['calls_per_step']:7.0f}x  {r['op']}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
