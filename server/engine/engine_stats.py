"""The engine's point-in-time stats: what /metrics, the router's heartbeats and the autoscaler read.

Taken by the engine thread after every step (and about once a second when idle), so it reads the
scheduler's queues and the pool's counters and never touches the model.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.kv_tier_policy import RESTORE_BUCKETS
from kvscale.server.core.scheduler import Scheduler
from kvscale.server.outputs import EngineStats

if TYPE_CHECKING:
    from kvscale.server.core.kv_offload import OffloadCounters
    from kvscale.server.worker.lora_manager import LoRAManager


def engine_stats(
    scheduler: Scheduler,
    kv: KVCacheManager,
    *,
    num_generated_tokens: int,
    num_prompt_tokens_computed: int,
    last_step_s: float,
    offload: OffloadCounters | None = None,
    lora: LoRAManager | None = None,
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
    extra = {
        "generation_tokens_total": float(num_generated_tokens),
        "prompt_tokens_computed_total": float(num_prompt_tokens_computed),
        "prefill_tokens_waiting": float(prefill_pending),
        "last_step_s": last_step_s,
        "max_num_batched_tokens": float(scheduler.max_num_batched_tokens),
        "max_num_seqs": float(scheduler.max_num_seqs),
        # With prefill_tokens_waiting, the seconds of prompt work queued here (the autoscaler's).
        "prefill_tokens_per_s": scheduler.step_rates.prefill_tokens_per_s,
        "num_decoding": float(num_decoding),
        "kv_blocks_evicted_total": float(pool.num_evicted),
        "enable_prefix_caching": float(kv.enable_prefix_caching),
    }
    extra.update(host_tier_stats(scheduler, kv, offload))
    running_loras: set[str] = set()
    waiting_loras: set[str] = set()
    if scheduler.max_loras:  # LoRA on: its adapters by state (vLLM's lora_requests_info)
        extra["max_loras"] = float(scheduler.max_loras)
        running_loras = {seq.request.lora_name for seq in scheduler.running if seq.request.lora_name}
        waiting_loras = {seq.request.lora_name for seq in scheduler.waiting if seq.request.lora_name}
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
        extra=extra,
        running_lora_adapters=sorted(running_loras),
        waiting_lora_adapters=sorted(waiting_loras),
        lora_adapters=sorted(lora.paths) if lora is not None else [],
        resident_lora_adapters=sorted(lora.resident) if lora is not None else [],
        # Requests, as num_running counts them (n samples run as n sequences of one request).
        running_by_priority=dict(Counter({seq.request.request_id: seq.request.priority
                                          for seq in scheduler.running}.values())),
    )


def host_tier_stats(scheduler: Scheduler, kv: KVCacheManager, offload: OffloadCounters | None) -> dict[str, float]:
    """The second KV tier's figures (absent keys read as zero: no tier)."""
    pool = kv.pool
    host = pool.host
    if host is None:
        return {}
    out = {
        "kv_host_blocks_total": float(host.num_slots),
        "kv_host_blocks_cached": float(host.num_cached),
        "kv_host_blocks_used": float(host.num_slots - host.num_free),
        "kv_blocks_demoted_total": float(pool.num_demoted),
        "kv_blocks_promoted_total": float(pool.num_promoted),
        "kv_preemptions_swapped_total": float(scheduler.num_swapped_out),
        "external_prefix_cache_queries_total": float(kv.host_cache_queries),
        "external_prefix_cache_hits_total": float(kv.host_cache_hits),
    }
    if offload is not None:
        out |= {
            "kv_offload_bytes_gpu_to_cpu": float(offload.bytes_down),
            "kv_offload_bytes_cpu_to_gpu": float(offload.bytes_up),
            "kv_offload_seconds_gpu_to_cpu": offload.seconds_down,
            "kv_offload_seconds_cpu_to_gpu": offload.seconds_up,
            "kv_restore_seconds_count": float(offload.restore_count),
            "kv_restore_seconds_sum": offload.restore_sum,
        }
        for bound, count in zip(RESTORE_BUCKETS, offload.restore_buckets, strict=True):
            out[f"kv_restore_seconds_le_{bound:g}"] = float(count)
    return out
