"""bench.gpu_engine's host KV tier: promotions and demotions through ``HostKVCache`` against one
contiguous pinned copy of the same bytes, and a step inside the engine that promotes, demotes and
writes into just-demoted blocks at once, every byte checked."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import sync


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
