"""The engine's point-in-time stats: what /metrics, the router's heartbeats and the autoscaler read.

Taken by the engine thread after every step (and about once a second when idle), so it reads the
scheduler's queues and the pool's counters and never touches the model.
"""

from __future__ import annotations

from kvscale.server.kv_cache_manager import KVCacheManager
from kvscale.server.outputs import EngineStats
from kvscale.server.scheduler import Scheduler


def engine_stats(
    scheduler: Scheduler,
    kv: KVCacheManager,
    *,
    num_generated_tokens: int,
    num_prompt_tokens_computed: int,
    last_step_s: float,
) -> EngineStats:
    pool = kv.pool
    running_requests = {seq.request.request_id for seq in scheduler.running}
    waiting_requests = {seq.request.request_id for seq in scheduler.waiting} - running_requests
    # For the router's TTFT prediction: prompt work queued here, and how many sequences decode.
    # A waiting prompt's cached prefix costs nothing: count what admission would still compute.
    prefill_pending = 0
    for seq in scheduler.waiting:
        cached = len(kv.find_cached_prefix(seq)) * kv.block_size if not seq.block_table else 0
        prefill_pending += seq.num_tokens - max(seq.num_computed_tokens, cached)
    num_decoding = 0
    for seq in scheduler.running:
        left = seq.num_tokens - seq.num_computed_tokens
        if left > 1:
            prefill_pending += left
        else:
            num_decoding += 1
    return EngineStats(
        num_running=len(running_requests),
        num_waiting=len(waiting_requests),
        kv_blocks_total=pool.num_blocks,
        kv_blocks_active=pool.num_active_blocks,
        kv_blocks_cached=pool.num_cached_free_blocks,
        block_size=kv.block_size,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        extra={
            "generation_tokens_total": float(num_generated_tokens),
            "prompt_tokens_computed_total": float(num_prompt_tokens_computed),
            "prefill_tokens_waiting": float(prefill_pending),
            "last_step_s": last_step_s,
            "max_num_batched_tokens": float(scheduler.max_num_batched_tokens),
            "num_decoding": float(num_decoding),
            "kv_blocks_evicted_total": float(pool.num_evicted),
            "enable_prefix_caching": float(kv.enable_prefix_caching),
        },
    )
