"""bench.gpu_engine's timings: W1 through the engine against transformers' static batches, and
one decode step of many sequences against its bandwidth roofline."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import sync


def w1(path: Path, device: Any, num_requests: int, max_num_seqs: int, baseline_batch: int | None,
       enforce_eager: bool = False, triton_layer_ops: bool = True, async_scheduling: bool | None = None) -> dict:
    from bench.gpu_kernels import triton_layer_ops as layer_ops_as

    with layer_ops_as(triton_layer_ops):
        return _w1(path, device, num_requests, max_num_seqs, baseline_batch, enforce_eager, async_scheduling) | {
            "triton_layer_ops": triton_layer_ops}


def _w1(path: Path, device: Any, num_requests: int, max_num_seqs: int, baseline_batch: int | None,
        enforce_eager: bool, async_scheduling: bool | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.w1_throughput import static_batches, workload
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    spec = SimpleNamespace(seed=0, num_requests=num_requests, min_prompt=32, max_prompt=512,
                           min_output=16, max_output=256)
    prompts, outputs = workload(spec)
    llm = LLM(model=str(path), dtype="bfloat16", device=str(device), max_num_seqs=max_num_seqs,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=4 * 1024**3, enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)
    overlapped = llm.llm_engine.async_scheduling
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    sync(device)
    started = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync(device)
    ours_s = time.perf_counter() - started
    assert sum(len(r.outputs[0].token_ids) for r in results) == sum(outputs)
    ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
    del llm, results
    if device.type == "cuda":
        torch.cuda.empty_cache()
    useful = sum(outputs)
    row = {"num_requests": num_requests, "max_num_seqs": max_num_seqs, "enforce_eager": enforce_eager,
           "async_scheduling": overlapped, "output_tokens": useful, "kvscale_output_tokens_per_s": useful / ours_s,
           "kvscale_mean_ttft_s": statistics.mean(ttfts)}
    if baseline_batch is None:
        return row

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
    with torch.inference_mode():
        baseline_s = static_batches(model, prompts, outputs, baseline_batch, device)
    return row | {"transformers_batch": baseline_batch, "transformers_output_tokens_per_s": useful / baseline_s,
                  "ratio": baseline_s / ours_s}


def decode_step(path: Path, device: Any, num_seqs: int, context: int, steps: int, peak_gbps: float | None,
                enforce_eager: bool = False, triton_layer_ops: bool = True, async_scheduling: bool | None = None) -> dict:
    from bench.gpu_kernels import triton_layer_ops as layer_ops_as

    with layer_ops_as(triton_layer_ops):
        return _decode_step(path, device, num_seqs, context, steps, peak_gbps, enforce_eager, async_scheduling) | {
            "triton_layer_ops": triton_layer_ops}


def _decode_step(path: Path, device: Any, num_seqs: int, context: int, steps: int, peak_gbps: float | None,
                 enforce_eager: bool, async_scheduling: bool | None) -> dict:
    import torch

    from bench.gpu_kernels import ModelShape
    from kvscale.processes import freeze_startup_heap
    from kvscale.server.engine.output_builder import OutputKind
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    budget = max(2048, context)
    # Sequences prefilled early decode while later prompts prefill (chunked prefill), so each
    # needs room for those tokens too; timing starts once every one of them is decoding.
    # Decodes share each step's token budget with the prefill chunks, which stretches the prefill.
    headroom = steps + 2 * -(-num_seqs * context // max(budget - num_seqs, 1)) + 16
    llm = LLM(model=str(path), dtype="bfloat16", device=str(device), max_num_seqs=num_seqs,
              max_num_batched_tokens=budget, max_model_len=context + headroom + 8,
              num_gpu_blocks_override=num_seqs * ((context + headroom) // 16 + 2) + 64, enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    # As the engine core runs under `kvscale serve`: deltas out, the front end detokenizes.
    engine.output_kind, engine.detokenize = OutputKind.DELTA, False
    # And as the core does once it is ready: what start-up built leaves the collector's full passes.
    freeze_startup_heap()
    params = SamplingParams(temperature=0.0, max_tokens=headroom, ignore_eos=True)
    for i in range(num_seqs):
        # Distinct prompts: no sequence shares a block with another, as in a decode-heavy fleet.
        engine.add_request(str(i), [3 + (i * 7919 + j * 104729) % 40000 for j in range(context)], params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in running):
        engine.step()
    if len(running) != num_seqs:
        raise RuntimeError(f"only {len(running)} of {num_seqs} sequences decode together (KV room or preemption)")
    tokens_before = sum(seq.num_tokens for seq in running)
    # No wait for the device between steps: a synchronous step waits for its own tokens anyway,
    # and with async scheduling a step's wall time is the period at which steps complete.
    decode_times = []
    # The garbage collector's passes while timed: a full one walks every object of the process
    # (torch, transformers: hundreds of thousands) and lands on whichever step it falls in.
    collections: list[list[float]] = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append([info["generation"], time.perf_counter()])
        else:
            collections[-1][1] = time.perf_counter() - collections[-1][1]

    sync(device)
    gc.callbacks.append(on_collection)
    run_started = time.perf_counter()
    try:
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            decode_times.append(time.perf_counter() - started)
        sync(device)
    finally:
        gc.callbacks.remove(on_collection)
    run_s = time.perf_counter() - run_started
    if len(running) != num_seqs:
        raise RuntimeError("a sequence finished or was preempted while the decode steps were timed")
    mean_context = (tokens_before + sum(seq.num_tokens for seq in running)) / 2 / num_seqs
    step_s = statistics.median(decode_times)
    engine_async = engine.async_scheduling
    spec = engine.runner.model.spec
    shape = ModelShape(num_layers=spec.num_layers, hidden=spec.hidden_size, num_heads=spec.num_heads,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                       intermediate=spec.intermediate_size, vocab=spec.vocab_size)
    weight_bytes = shape.weight_params() * 2  # bfloat16; counted from the shapes, as the CPU path packs its weights
    cache_bytes = engine.runner.kv_cache.element_size()
    kv_bytes = round(num_seqs * mean_context) * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * cache_bytes
    logits_bytes = num_seqs * spec.vocab_size * 4
    roofline_s = (weight_bytes + kv_bytes + logits_bytes) / (peak_gbps * 1e9) if peak_gbps else None
    del llm, engine
    gc.unfreeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "num_seqs": num_seqs, "context": context, "mean_context_timed": mean_context, "enforce_eager": enforce_eager,
        "async_scheduling": engine_async, "decode_steps": len(decode_times),
        "step_ms_median": step_s * 1000, "step_ms_mean_of_run": run_s / len(decode_times) * 1000,
        "step_ms_each": [round(t * 1000, 3) for t in decode_times],
        "gc_collections_timed": [{"generation": g, "ms": round(ms * 1000, 3)} for g, ms in collections],
        "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes,
        "roofline_ms": roofline_s * 1000 if roofline_s else None,
        "fraction_of_roofline": roofline_s / step_s if roofline_s else None,
        "output_tokens_per_s": num_seqs / step_s,
    }
