"""The second KV tier (host memory): hit rate, restore vs recompute, overhead, swap vs recompute.

Four figures, each with its baseline measured in the same run (docs/performance.md, "Host KV tier", quotes them):

1. **Hit rate** (prompt tokens found cached / looked up) replaying multi-turn conversations whose
   working set exceeds the first tier, for three pools: tier 1 of N blocks + tier 2 of 4N, one flat
   pool of 5N (the upper bound), tier 1 of N alone. The replay drives the engine's own block pool,
   host tier, KV cache manager and scheduler step by step (batches of up to 16 sequences, a
   2048-token budget); only the forward pass is left out, since which blocks are cached does not
   depend on what the model computes. Workloads:
   - the Mooncake conversation trace (``../shared/data/traces/``, first ``--trace-requests``
     requests in arrival order, closed loop), scaled as its README suggests: each 512-token hash
     block becomes one 16-token KV block (a fixed pseudo-random token string per hash id), the
     output length is divided by 32 too (at least one token), generated tokens are unique;
   - W4 (bench/w3_workloads.py's multi-turn chat, in tokens): conversations of 3-6 turns, turn 1 a
     512-token document + 32-token question, each later turn the whole history + a 32-token answer
     + a new 32-token question; turns of different conversations interleaved at random.
2. **TTFT of a revisit whose 2k-token prefix sits in tier 2**, against the same revisit on an
   engine without the tier (its prefix evicted, so recomputed). Real bundled model, float32.
3. **Throughput with no reuse**, tier on vs off: unique prompts through a pool small enough that
   every block is evicted (and, with the tier, demoted), runs interleaved.
4. **Resume after preemption**: a 1k-token sequence is preempted (the scheduler's own
   preemption: swap out when there is a tier) and its tier-1 blocks are then taken by other work;
   time from its re-admission to its next token, swapped (promoted) vs recomputed.

    flock /tmp/kvscale-bench.lock python -m bench.kv_tier   # writes bench/results/kv_tier.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import MOONCAKE_TRACE, machine, shared_data, write_result
from bench.roofline import cpu_isa

# ../shared/data/traces/ next to the checkout (its README: never copied into the repo).
BS = 16


# --- 1. hit rate: the engine's cache and scheduler, steps simulated ----------------------------
def _block_tokens(hash_id: int, cache: dict[int, list[int]]) -> list[int]:
    tokens = cache.get(hash_id)
    if tokens is None:
        rng = random.Random(hash_id * 7919 + 1)
        tokens = cache[hash_id] = [rng.randrange(100, 49000) for _ in range(BS)]
    return tokens


def trace_requests(path: Path, count: int) -> list[tuple[list[int], int]]:
    """(prompt tokens, output tokens) per request, scaled 512 → 16 tokens per hash block."""
    cache: dict[int, list[int]] = {}
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= count:
                break
            r = json.loads(line)
            prompt = [t for h in r["hash_ids"] for t in _block_tokens(h, cache)]
            out.append((prompt, max(1, round(r["output_length"] / 32))))
    return out


def w4_turns(seed: int, conversations: int) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, new tokens) in arrival order; a turn's prompt is its history + these."""
    rng = random.Random(seed)
    convs = []
    for _ in range(conversations):
        turns = rng.randint(3, 6)
        doc = [rng.randrange(1000, 40000) for _ in range(512)]
        qs = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(turns)]
        convs.append([doc + qs[0]] + qs[1:])
    pending = [0] * conversations
    order = []
    while any(pending[c] < len(convs[c]) for c in range(conversations)):
        c = rng.choice([c for c in range(conversations) if pending[c] < len(convs[c])])
        order.append((c, pending[c], convs[c][pending[c]]))
        pending[c] += 1
    return order


def replay(num_blocks: int, host_blocks: int, source, answers: int = 32, concurrency: int = 16) -> dict:
    """Drive the real pool, tier and scheduler through ``source`` (a list of requests or W4 turns)."""
    from kvscale.server.core.block_pool import BlockPool
    from kvscale.server.core.host_tier import HostTier
    from kvscale.server.core.kv_cache_manager import KVCacheManager
    from kvscale.server.core.scheduler import Scheduler
    from kvscale.server.core.sequence import Request, Sequence
    from kvscale.server.outputs import RequestMetrics
    from kvscale.server.sampling_params import SamplingParams

    pool = BlockPool(num_blocks, BS, True, HostTier(host_blocks) if host_blocks else None)
    kv = KVCacheManager(pool)
    sched = Scheduler(kv, concurrency, 2048)
    unique = iter(range(10**9))
    w4 = isinstance(source[0][0], int)
    history: dict[int, list[int]] = {}
    queue = list(source)
    queue.reverse()
    waiting_conv: set[int] = set()
    deferred: list = []

    def make(prompt: list[int], max_tokens: int, tag: int) -> Sequence:
        request = Request(str(next(unique)), None, prompt, SamplingParams(max_tokens=max_tokens), None,
                          RequestMetrics(0.0), max_tokens)
        seq = Sequence(request, 0, list(prompt), len(prompt))
        seq.tag = tag  # type: ignore[attr-defined]
        request.seqs.append(seq)
        return seq

    skipped = 0
    while queue or deferred or sched.has_unfinished():
        # Keep the batch full: W4 turns wait for their conversation's previous turn.
        while (queue or deferred) and len(sched.waiting) + len(sched.running) < concurrency + 4:
            item = None
            for i, d in enumerate(deferred):
                if d[0] not in waiting_conv:
                    item = deferred.pop(i)
                    break
            if item is None and queue:
                item = queue.pop()
                if w4 and item[0] in waiting_conv:
                    deferred.append(item)
                    continue
            if item is None:
                break
            if w4:
                conv, _, new = item
                prompt = history.get(conv, []) + new
                seq = make(prompt, answers, conv)
                waiting_conv.add(conv)
            else:
                prompt, out_len = item
                if -(-(len(prompt) + out_len) // BS) > num_blocks:
                    skipped += 1  # longer than tier 1 itself: admission would refuse it
                    continue
                seq = make(prompt, out_len, -1)
            sched.add(seq)
        out = sched.schedule()
        kv.take_tier_copies()
        kv.take_pending_copies()
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(100 + next(unique) % 48000)
                if seq.num_output_tokens >= seq.request.max_tokens:
                    sched.finish(seq)
                    if w4:
                        history[seq.tag] = list(seq.token_ids)  # type: ignore[attr-defined]
                        waiting_conv.discard(seq.tag)  # type: ignore[attr-defined]
    assert pool.num_active_blocks == 0
    return {
        "hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0,
        "hit_tokens": kv.prefix_cache_hits,
        "query_tokens": kv.prefix_cache_queries,
        "promoted_blocks": pool.num_promoted,
        "demoted_blocks": pool.num_demoted,
        "preemptions": sched.num_preemptions,
        "skipped_too_long": skipped,
    }


def hit_rates(name: str, n: int, source) -> dict:
    started = time.perf_counter()
    tiered = replay(n, 4 * n, source)
    flat = replay(5 * n, 0, source)
    alone = replay(n, 0, source)
    return {
        "workload": name,
        "tier1_blocks": n,
        "tiered_N_plus_4N": tiered,
        "flat_5N": flat,
        "tier1_N_alone": alone,
        "tiered_minus_flat_points": round(100 * (tiered["hit_rate"] - flat["hit_rate"]), 2),
        "tiered_over_alone": round(tiered["hit_rate"] / alone["hit_rate"], 3) if alone["hit_rate"] else None,
        "seconds": round(time.perf_counter() - started, 1),
    }


# --- 2-4. the real model ------------------------------------------------------------------------
def _engine(blocks: int, tier_gib: float):
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", device="cpu", num_gpu_blocks_override=blocks,
                                  kv_offloading_size=tier_gib, max_num_batched_tokens=4096))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _until_first_token(engine, rid: str) -> float:
    started = time.perf_counter()
    while True:
        for o in engine.step():
            if o.request_id == rid and o.outputs[0].token_ids:
                return time.perf_counter() - started


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _push_out_of_tier1(engine) -> None:
    """Other work takes every free tier-1 block, as memory pressure would: the cached ones are
    evicted (demoted, where there is a tier). Real pool operations; the copies run at once."""
    pool = engine.pool
    taken = [pool.allocate() for _ in range(pool.num_free_blocks)]
    pool.free(taken)
    engine.runner.move_between_tiers(engine.kv.take_tier_copies())


def revisit_ttft(repeats: int, prefix_tokens: int = 2048) -> dict:
    """TTFT of a prompt whose prefix sits in tier 2, vs the same prompt recomputed (no tier; its
    prefix evicted, which is where an engine without the tier stands after the same traffic)."""
    from kvscale.server.sampling_params import SamplingParams

    blocks = prefix_tokens // BS + 8  # one such prompt and change
    tier_gib = 2 * blocks * 737 * 1024 / 1024**3
    engines = {"tier2_restore": _engine(blocks, tier_gib), "recompute": _engine(blocks, 0.0)}
    rng = random.Random(0)
    samples: dict[str, list[float]] = {k: [] for k in engines}
    promoted: list[int] = []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for engine in engines.values():  # warm-up: first steps pay one-off costs
        engine.add_request("warm", _tokens(rng, 64), params)
        _drain(engine)
    for rep in range(repeats):
        prefix, tail = _tokens(rng, prefix_tokens), _tokens(rng, 16)
        for name, engine in engines.items():  # interleaved: same machine state for both
            if name == "tier2_restore":
                engine.add_request(f"a{rep}", prefix + _tokens(rng, 8), params)
                _drain(engine)
                _push_out_of_tier1(engine)
                assert engine.pool.host is not None and engine.pool.host.num_cached
            before = engine.pool.num_promoted
            engine.add_request(f"c{rep}", prefix + tail, params)
            samples[name].append(_until_first_token(engine, f"c{rep}"))
            _drain(engine)
            if name == "tier2_restore":
                promoted.append(engine.pool.num_promoted - before)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "prefix_tokens": prefix_tokens,
        "tier1_blocks": blocks,
        "samples_s": samples,
        "median_s": med,
        "promoted_blocks_per_revisit": promoted,
        "speedup": round(med["recompute"] / med["tier2_restore"], 2),
    }


def no_reuse_throughput(repeats: int, prompts: int = 8, prompt_tokens: int = 128, out_tokens: int = 8) -> dict:
    """Unique prompts through a pool that evicts every block: tier on (demotes) vs off.

    Runs alternate (on, off, off, on, ...); each pair's ratio is taken from adjacent runs, so a
    machine that slows down for a while slows both sides of a pair. Besides wall time, the
    process's CPU time (less sensitive to other processes taking the cores) and the seconds the
    tier's copies took are recorded."""
    from kvscale.server.sampling_params import SamplingParams

    blocks = 4 * -(-(prompt_tokens + out_tokens) // BS)  # ~4 sequences' worth: constant eviction
    engines = {"tier_on": _engine(blocks, 0.25), "tier_off": _engine(blocks, 0.0)}
    rng = random.Random(1)
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    copy_s: list[float] = []
    demoted = 0
    tokens = prompts * (prompt_tokens + out_tokens)
    for rep in range(-1, repeats):  # rep -1: warm-up, untimed
        batch = [_tokens(rng, prompt_tokens) for _ in range(prompts)]
        order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
        for name, engine in order:
            params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
            before = engine.pool.num_demoted
            counters = engine.runner.host_cache.counters if engine.runner.host_cache else None
            copied_before = counters.seconds_down + counters.seconds_up if counters else 0.0
            started, cpu_started = time.perf_counter(), time.process_time()
            for i, p in enumerate(batch):
                engine.add_request(f"{rep}-{i}", p, params)
            _drain(engine)
            if rep < 0:
                continue
            wall[name].append(tokens / (time.perf_counter() - started))
            cpu[name].append(tokens / (time.process_time() - cpu_started))
            if counters is not None:
                demoted += engine.pool.num_demoted - before
                copy_s.append(counters.seconds_down + counters.seconds_up - copied_before)
    pair_wall = [a / b for a, b in zip(wall["tier_on"], wall["tier_off"], strict=True)]
    pair_cpu = [a / b for a, b in zip(cpu["tier_on"], cpu["tier_off"], strict=True)]
    run_s = [tokens / t for t in wall["tier_on"]]
    return {
        "prompts_per_run": prompts, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "tier1_blocks": blocks, "wall_tokens_per_s": wall, "cpu_tokens_per_s": cpu,
        "demoted_blocks_tier_on": demoted,
        "median_pair_ratio_wall": round(statistics.median(pair_wall), 3),
        "median_pair_ratio_cpu": round(statistics.median(pair_cpu), 3),
        "ratio_of_medians_wall": round(statistics.median(wall["tier_on"]) / statistics.median(wall["tier_off"]), 3),
        "copy_seconds_per_run": copy_s,
        "median_copy_share_of_run": round(statistics.median(c / r for c, r in zip(copy_s, run_s, strict=True)), 5),
    }


def swap_resume(repeats: int, context_tokens: int = 1024) -> dict:
    """Time from re-admission to the next token of a preempted sequence: swapped vs recomputed."""
    from kvscale.server.sampling_params import SamplingParams

    blocks = context_tokens // BS + 24
    engines = {"swap": _engine(blocks, 2 * blocks * 737 * 1024 / 1024**3), "recompute": _engine(blocks, 0.0)}
    rng = random.Random(2)
    samples: dict[str, list[float]] = {k: [] for k in engines}
    swapped = []
    for rep in range(repeats):
        prompt = _tokens(rng, context_tokens)
        for name, engine in engines.items():
            rid = f"s{rep}"
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
            engine.step()  # prefill + first token
            seq = engine.requests[rid].seqs[0]
            sched = engine.scheduler
            # The scheduler's own preemption path (swap out when the tier makes it cheaper).
            before = sched.num_swapped_out
            sched.running.remove(seq)
            sched._preempt(seq)
            if name == "swap":
                swapped.append(sched.num_swapped_out - before)
            # Other work takes every tier-1 block, as the memory pressure that preempted it would.
            _push_out_of_tier1(engine)
            n_before = len(seq.token_ids)
            started = time.perf_counter()
            while len(seq.token_ids) == n_before:
                engine.step()
            samples[name].append(time.perf_counter() - started)
            _drain(engine)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "context_tokens": context_tokens, "tier1_blocks": blocks, "samples_s": samples, "median_s": med,
        "swapped_out": swapped, "speedup": round(med["recompute"] / med["swap"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=None, help="default: ../shared/data/traces/ (Mooncake)")
    parser.add_argument("--trace-requests", type=int, default=3000)
    parser.add_argument("--trace-blocks", type=int, default=1024, help="N, tier 1 for the trace")
    parser.add_argument("--w4-conversations", type=int, default=64)
    parser.add_argument("--w4-blocks", type=int, default=512, help="N, tier 1 for W4")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (medians)")
    parser.add_argument("--parts", default="hit,revisit,noreuse,swap",
                        help="comma-separated: hit (hit rates), revisit, noreuse, swap (the model's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    parts = set(args.parts.split(","))
    result: dict = {
        "benchmark": "kv_tier", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(), "cpu_isa": cpu_isa(), "repeats": args.repeats,
    }
    if "hit" in parts:
        result["hit_rate"] = [
            hit_rates(f"mooncake-conversation first {args.trace_requests} (512 → 16 tokens per hash block)",
                      args.trace_blocks, trace_requests(args.trace or shared_data(*MOONCAKE_TRACE), args.trace_requests)),
            hit_rates(f"W4 {args.w4_conversations} conversations", args.w4_blocks,
                      w4_turns(0, args.w4_conversations)),
        ]
        print(json.dumps(result["hit_rate"], indent=1), file=sys.stderr)
    for part, key, run in (("revisit", "revisit_ttft", revisit_ttft), ("noreuse", "no_reuse_throughput",
                           no_reuse_throughput), ("swap", "swap_resume", swap_resume)):
        if part in parts:
            result[key] = run(args.repeats)
            print(json.dumps(result[key]), file=sys.stderr)
    print(write_result("kv_tier", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
