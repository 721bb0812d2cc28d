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
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import GREEDY_PROMPTS, machine, write_result


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_equality(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    # The repeat shares the third prompt's first two blocks (32 tokens): a prefix-cache hit.
    repeat = prompts[2][:32] + prompts[0]
    # Both sides stop at the end-of-sequence token: with ignore_eos the engine may emit it and go
    # on (vLLM's meaning), while transformers' min_new_tokens forbids it, so they would differ there.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=8,
              max_num_batched_tokens=64, num_gpu_blocks_override=256)
    ours = [list(r.outputs[0].token_ids) for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    ours.append(list(llm.generate([{"prompt_token_ids": repeat}], params)[0].outputs[0].token_ids))
    hits = llm.llm_engine.get_stats().prefix_cache_hits - hits_before
    del llm
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    rows = []
    with torch.inference_mode():
        for i, prompt in enumerate([*prompts, repeat]):
            ids = torch.tensor([prompt], device=device)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            first_difference = next((j for j, (a, b) in enumerate(zip(ours[i], ref, strict=False)) if a != b),
                                    None if len(ours[i]) == len(ref) else min(len(ours[i]), len(ref)))
            rows.append({"prompt": i, "equal": ours[i] == ref, "first_difference": first_difference})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": dtype, "new_tokens": new_tokens, "prefix_cache_hits_on_repeat": hits,
            "equal": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows}


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


def graphs_vs_eager(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    """Greedy tokens of the engine replaying decode graphs against the same engine eager, on
    batches that pad (5 prompts: the graph of 8) and that do not."""
    from transformers import AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in GREEDY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=16, max_num_batched_tokens=256,
                  num_gpu_blocks_override=256, enforce_eager=eager)
        tokens[eager] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
        tokens[eager] += [list(r.outputs[0].token_ids) for r in llm.generate(prompts[:1], params)]
        graphs = llm.llm_engine.runner.decode_graphs
        if not eager and device.type == "cuda":
            assert graphs is not None and graphs.sizes[-1] == 16, "no decode graphs were captured"
        del llm
    rows = [{"equal": a == b, "first_difference": next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)}
            for a, b in zip(tokens[True], tokens[False], strict=True)]
    return {"dtype": dtype, "equal": sum(r["equal"] for r in rows), "sequences": len(rows), "rows": rows}


def async_vs_sync(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    """Greedy tokens with async scheduling against the same engine stepping synchronously, decode
    graphs on, with every way a sequence ends (end token, stop string, max_tokens)."""
    from transformers import AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in GREEDY_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=max(new_tokens - 3 * i, 2), ignore_eos=i % 2 == 0,
                             stop=[".", "\n\n"] if i == 1 else [])
              for i in range(len(prompts))]
    tokens = {}
    for overlapped in (False, True):
        llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=16, max_num_batched_tokens=256,
                  num_gpu_blocks_override=256, async_scheduling=overlapped)
        tokens[overlapped] = [(list(r.outputs[0].token_ids), r.outputs[0].finish_reason)
                              for r in llm.generate(prompts, params)]
        del llm
    rows = [a == b for a, b in zip(tokens[False], tokens[True], strict=True)]
    return {"dtype": dtype, "equal": sum(rows), "sequences": len(rows),
            "finish_reasons": [reason for _, reason in tokens[True]]}


def host_tier(device: Any, num_blocks: int, repeats: int) -> dict:
    import torch

    from kvscale.server.core.block_pool import TierCopies
    from kvscale.server.core.kv_offload import HostKVCache

    # The bundled model's cache: [layer, k|v, block, offset, kv_head, head_dim], bfloat16.
    cache = torch.zeros((30, 2, num_blocks + 8, 16, 3, 64), dtype=torch.bfloat16, device=device)
    tier = HostKVCache(num_blocks, cache)
    tier.host.normal_()
    nbytes = num_blocks * tier.block_bytes
    result: dict[str, Any] = {"blocks": num_blocks, "bytes": nbytes, "block_bytes": tier.block_bytes}

    def timed(copies: TierCopies) -> tuple[float, float]:
        """Wall time of one ``run`` until its copies landed, and the promotion's event time."""
        sync(device)
        before = tier.counters.restore_sum
        started = time.perf_counter()
        tier.run(cache, copies)
        sync(device)
        wall = time.perf_counter() - started
        tier.run(cache, TierCopies())  # collects the last promotion's event timing
        return wall, tier.counters.restore_sum - before

    # Slots in order (a prefix demoted together) and shuffled (a tier after long churn).
    for name, order in (("sequential", list(range(num_blocks))), ("shuffled", torch.randperm(num_blocks).tolist())):
        promote = TierCopies(promote=[(slot, block) for block, slot in enumerate(order)])
        samples = [timed(promote) for _ in range(repeats + 1)][1:]
        assert torch.equal(cache[:, :, :num_blocks].cpu(), tier.host[order].movedim(0, 2)), f"{name}: promoted bytes differ"
        result[f"promote_{name}_wall_ms"] = statistics.median(w for w, _ in samples) * 1000
        result[f"promote_{name}_event_ms"] = statistics.median(e for _, e in samples) * 1000
        demote = TierCopies(demote=[(block, slot) for block, slot in enumerate(order)])
        cache[:, :, :num_blocks].normal_()
        walls = [timed(demote)[0] for _ in range(repeats + 1)][1:]
        assert torch.equal(tier.host[order].movedim(0, 2), cache[:, :, :num_blocks].cpu()), f"{name}: demoted bytes differ"
        result[f"demote_{name}_wall_ms"] = statistics.median(walls) * 1000
    if device.type == "cuda":
        source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        up, down = [], []
        for _ in range(repeats + 1):
            for samples, copy in ((up, lambda: target.copy_(source, non_blocking=True)),
                                  (down, lambda: source.copy_(target, non_blocking=True))):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                copy()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000)
        link_up, link_down = statistics.median(up[1:]), statistics.median(down[1:])
        result["link_up_gbps"] = nbytes / link_up / 1e9
        result["link_down_gbps"] = nbytes / link_down / 1e9
        for name in ("sequential", "shuffled"):
            result[f"promote_{name}_wall_ratio_to_link"] = link_up * 1000 / result[f"promote_{name}_wall_ms"]
            result[f"promote_{name}_event_ratio_to_link"] = link_up * 1000 / result[f"promote_{name}_event_ms"]
            result[f"demote_{name}_wall_ratio_to_link"] = link_down * 1000 / result[f"demote_{name}_wall_ms"]
    return result


def tier_in_engine(path: Path, device: Any) -> dict:
    """One step that promotes a prefix, demotes other blocks and writes new K/V into blocks it
    just demoted (tests/server/engine/test_kv_tier_engine.py's case, here on the GPU's copy stream):
    every block that went down or came up holds exactly the bytes it held before."""
    import torch

    from kvscale.block_hash import hash_block_tokens
    from kvscale.server.config import EngineConfig
    from kvscale.server.core.block_pool import TierCopies
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams

    def tokens(start: int, n: int) -> list[int]:
        return [(start + 7 * i) % 40000 + 100 for i in range(n)]

    def hashes(prompt: list[int]) -> list[int]:
        out: list[int] = []
        for i in range(len(prompt) // 16):
            out.append(hash_block_tokens(out[-1] if out else None, prompt[i * 16 : (i + 1) * 16], ()))
        return out

    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device=str(device),
                                    num_gpu_blocks_override=16, kv_offloading_size=0.02))
    runner = engine.runner

    def content(block_hash: int) -> torch.Tensor:
        sync(device)
        block = engine.pool.lookup(block_hash)
        if block is not None:
            return runner.kv_cache[:, :, block].to("cpu", copy=True)
        return runner.host_cache.host[engine.pool.host._entries[block_hash].slot].clone()

    def finish(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()

    q1, q2 = tokens(1, 64), tokens(5000, 240)
    finish("q1", q1)
    q1_kv = {h: content(h) for h in hashes(q1)}
    finish("q2", q2)
    demoted_first = all(h in engine.pool.host for h in q1_kv)
    q2_kv = {h: content(h) for h in hashes(q2) if engine.pool.lookup(h) is not None}
    seen: list[TierCopies] = []
    move = runner.move_between_tiers

    def recording(copies: TierCopies) -> None:
        seen.append(TierCopies(list(copies.demote), list(copies.promote)))
        move(copies)

    runner.move_between_tiers = recording
    engine.add_request("q1b", q1 + tokens(9000, 8), SamplingParams(temperature=0.0, max_tokens=4))
    engine.add_request("n", tokens(20000, 80), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()
    written = set(engine.requests["n"].seqs[0].block_table)
    rewritten = len(written & {b for b, _ in seen[0].demote}) if seen else 0
    demoted_intact = sum(torch.equal(content(h), kv) for h, kv in q2_kv.items())
    promoted_intact = sum(engine.pool.lookup(h) is not None and torch.equal(content(h), kv) for h, kv in q1_kv.items())
    while engine.has_unfinished_requests():
        engine.step()
    counters = runner.host_cache.counters
    return {
        "q1_demoted_by_q2": demoted_first, "promoted": len(seen[0].promote) if seen else 0,
        "demoted": len(seen[0].demote) if seen else 0, "demoted_blocks_rewritten_same_step": rewritten,
        "demoted_intact": f"{demoted_intact}/{len(q2_kv)}", "promoted_intact": f"{promoted_intact}/{len(q1_kv)}",
        "ok": demoted_first and rewritten > 0 and demoted_intact == len(q2_kv) and promoted_intact == len(q1_kv),
        "restores": counters.restore_count, "restore_seconds": counters.restore_sum,
    }


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
