"""bench.lora's engine sides, each run in its own process (bench.common.run_side): the offline
engine's tokens/s with adapters mixed in one batch against the base model alone, transformers +
PEFT on the same requests, and where the time of a LoRA projection goes.

Same requests on every side (bench.w1_throughput's workload: random token ids, greedy,
``ignore_eos``). The engine sides are two ``LLM`` objects in one process: one without LoRA (the base
model alone, what a user serving no adapter runs) and one with ``--enable-lora`` and every mixed
adapter resident (``--max-loras`` = their count), which runs the requests once with no adapter and
once each naming one of the adapters in turn. Their passes alternate, the order rotated per round
(a shared machine's speed drifts); each pass has its own ``cache_salt`` so none reuses another's
prefix cache. After the rounds each engine side's prefill alone is timed (the prompts with one
output token each), so a pass splits into prefill and decode. PEFT runs them in static batches
as bench.w1_throughput's transformers baseline, a batch's rows naming their adapters (PEFT's
mixed-adapter batches, ``adapter_names``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import median_ms, peak_rss_bytes
from bench.w1_throughput import static_batches, workload


def adapter_paths(args: argparse.Namespace, count: int) -> dict[str, str]:
    """The first ``count`` adapters bench.lora made in ``--adapter-dir`` (name -> PEFT directory)."""
    folders = sorted(p for p in Path(args.adapter_dir).iterdir() if p.is_dir())[:count]
    return {p.name: str(p) for p in folders}


def mixed_names(num_requests: int, adapters: list[str]) -> list[str | None]:
    """Request i names adapter i mod len(adapters): every adapter in every batch of that many."""
    return [adapters[i % len(adapters)] for i in range(num_requests)]


def _llm(args: argparse.Namespace, **lora: Any) -> Any:
    from kvscale.server.entrypoints.llm import LLM

    return LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.num_requests,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_bytes,
               **lora)


def engine_pass(engine: Any, prompts: list[list[int]], outputs: list[int], names: Sequence[str | None],
                tag: str) -> float:
    """Every request at once, each naming its adapter (None: the base model); output tokens/s."""
    from kvscale.server.sampling_params import SamplingParams

    started = time.perf_counter()
    for i, (prompt, n, name) in enumerate(zip(prompts, outputs, names, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           cache_salt=tag, lora_name=name)
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    assert generated == sum(outputs), "the engine generated a different number of tokens"
    return generated / elapsed


def projection_profile(manager: Any, names: Sequence[str | None], dtype: Any, repeats: int) -> dict[str, Any]:
    """Where a decode step's projections spend their time with these rows' adapters: every
    wrapped projection of the model on ``len(names)`` rows, its base GEMM alone and with the LoRA
    deltas (ms summed over the model's projections, medians), and torch's own op table for the
    latter (the top ops by self time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    rows = len(names)
    manager.set_step(names, [1] * rows)
    inputs = [torch.randn(rows, proj.in_features, dtype=dtype) for proj in manager.wrapped]
    per_kind: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for proj, x in zip(manager.wrapped, inputs, strict=True):
            kind = per_kind.setdefault(proj.key[1], {"base_ms": 0.0, "with_lora_ms": 0.0})
            kind["base_ms"] += median_ms(partial(proj.base, x), repeats, warmup=2)
            kind["with_lora_ms"] += median_ms(partial(proj, x), repeats, warmup=2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                for proj, x in zip(manager.wrapped, inputs, strict=True):
                    proj(x)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    base = sum(k["base_ms"] for k in per_kind.values())
    with_lora = sum(k["with_lora_ms"] for k in per_kind.values())
    return {
        "rows": rows, "adapters": len({n for n in names if n is not None}),
        "base_ms": base, "with_lora_ms": with_lora, "lora_share": (with_lora - base) / with_lora,
        "by_projection": per_kind,
        "top_ops": [{"op": e.key, "calls": e.count, "self_share": e.self_cpu_time_total / total_us}
                    for e in events[:8]],
    }


def side_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    paths = adapter_paths(args, args.mixed_adapters)
    prompts, outputs = workload(args)
    plain = _llm(args).llm_engine
    lora = _llm(args, enable_lora=True, lora_modules=paths, max_loras=len(paths),
                max_lora_rank=args.rank).llm_engine
    sides: dict[str, tuple[Any, Sequence[str | None]]] = {
        "base": (plain, [None] * len(prompts)),
        "base_on_lora_engine": (lora, [None] * len(prompts)),
        "mixed": (lora, mixed_names(len(prompts), list(paths)))}
    for side, (engine, names) in sides.items():  # untimed: first-use costs, adapters resident
        engine_pass(engine, [p[:32] for p in prompts[:8]], [4] * 8, names[:8], f"warm-{side}")
    passes: dict[str, list[float]] = {side: [] for side in sides}
    order = list(sides)
    for r in range(args.rounds):
        for side in order[r % len(order):] + order[:r % len(order)]:
            engine, names = sides[side]
            passes[side].append(engine_pass(engine, prompts, outputs, names, f"r{r}-{side}"))
    # Where the mixed side's extra time goes, prefill or decode: the same prompts once more, one
    # output token each (their prefill, in the steps a full pass prefills them in), best of two
    # per side; the rest of a pass's time is its decode.
    prefill_s = {side: min(len(prompts) / engine_pass(sides[side][0], prompts, [1] * len(prompts), sides[side][1],
                                                        f"prefill{r}-{side}") for r in range(2))
                 for side in ("base", "mixed")}
    ratios = [m / b for m, b in zip(passes["mixed"], passes["base"], strict=True)]
    result: dict[str, Any] = {
        "tok_s": passes,
        "tok_s_median": {side: statistics.median(v) for side, v in passes.items()},
        "mixed_over_base_paired": ratios,
        "mixed_over_base_median": statistics.median(ratios),
        "prefill_s": prefill_s,
        "decode_s": {side: sum(outputs) / statistics.median(passes[side]) - prefill_s[side] for side in prefill_s},
        "dtype": str(lora.dtype).removeprefix("torch."),
        "adapters": list(paths),
        "torch_threads": torch.get_num_threads(),
    }
    manager = lora.runner.lora
    result["profile_mixed"] = projection_profile(manager, mixed_names(len(prompts), list(paths)), lora.dtype,
                                                 args.profile_repeats)
    result["profile_one_adapter"] = projection_profile(manager, [next(iter(paths))] * len(prompts), lora.dtype,
                                                       args.profile_repeats)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def side_peft(args: argparse.Namespace) -> dict[str, Any]:
    """transformers + PEFT on the same requests: the base model, then the same requests each
    naming its adapter (static batches, mixed adapters in a batch)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvscale.model_files import resolve_model_path
    from kvscale.server.worker.model_loader import resolve_dtype

    torch.set_num_threads(args.threads)
    paths = adapter_paths(args, args.mixed_adapters)
    prompts, outputs = workload(args)
    path = resolve_model_path(None)
    dtype = resolve_dtype(args.dtype, AutoConfig.from_pretrained(str(path)), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    cpu = torch.device("cpu")
    with torch.inference_mode():
        base_s = static_batches(model, prompts, outputs, args.batch_size, cpu)
    names = list(paths)
    peft_model = PeftModel.from_pretrained(model, paths[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft_model.load_adapter(paths[name], adapter_name=name)
    rows = [n for n in mixed_names(len(prompts), names) if n is not None]
    with torch.inference_mode():
        mixed_s = static_batches(peft_model, prompts, outputs, args.batch_size, cpu, adapter_names=rows)
    useful = sum(outputs)
    return {"tok_s": {"base": useful / base_s, "mixed": useful / mixed_s}, "batch_size": args.batch_size,
            "dtype": str(dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
            "peak_rss_bytes": peak_rss_bytes()}
