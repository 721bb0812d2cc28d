"""The second KV tier's memory and the copies between it and the KV cache.

The host tier is one tensor allocated once when the engine starts, slot-major:
``[slot, layer, k|v, offset, kv_head, head_dim]``, so each block is one contiguous piece of host
memory (the cache keeps ``[layer, k|v, block, ...]``; a block there is ``2 × layers`` pieces).
It is pinned when the cache is on a GPU, so the copies are DMA straight from and into the tier's
slots, one copy per run of consecutive slots, with no gather or scatter on the host; on CPU it is
plain memory. A step's copies run before its forward, in one batch each way: demotions
(cache → host) first, since a demoted block may be handed out again and written by this very
step, then promotions (host → cache).

On a GPU both directions run on a copy stream of their own, ordered by events, never by sleeps.
A demotion gathers its blocks on the device (after the compute stream's writers) and the compute
stream waits only for that gather, not for the copy down; a promotion copies its slots up into a
device buffer and scatters them into the cache, and the compute stream waits for it before the
forward reads the promoted blocks. Every copy touching the tier's slots is on the one copy
stream, so a slot handed out again (host_tier.py releases promoted slots after the step) is
written only after the copy that read it. On CPU the same two batches are plain
``index_select`` / ``index_copy_`` calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvscale.kernels import fp8
from kvscale.server.core.block_pool import TierCopies
from kvscale.server.core.kv_tier_policy import RESTORE_BUCKETS
from kvscale.server.core.zeroed_memory import lazily_zeroed


@dataclass
class OffloadCounters:
    """What the copies moved and took (cumulative), for the metrics and the swap-or-recompute
    choice. The restore-latency histogram is kept as cumulative bucket counts, so it is a few
    numbers however long the engine runs."""

    bytes_down: int = 0
    bytes_up: int = 0
    seconds_down: float = 0.0
    seconds_up: float = 0.0
    restore_buckets: list[int] = field(default_factory=lambda: [0] * len(RESTORE_BUCKETS))
    restore_count: int = 0
    restore_sum: float = 0.0

    def observe_restore(self, seconds: float) -> None:
        self.seconds_up += seconds
        self.restore_count += 1
        self.restore_sum += seconds
        for i, bound in enumerate(RESTORE_BUCKETS):
            if seconds <= bound:
                self.restore_buckets[i] += 1

    @property
    def copy_bytes_per_s(self) -> float:
        seconds = self.seconds_down + self.seconds_up
        return (self.bytes_down + self.bytes_up) / seconds if seconds > 0 else 0.0


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots in list order, as ``(position, first slot, length)``:
    each run is one contiguous copy of the slot-major tier."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and slot == runs[-1][1] + runs[-1][2] and position == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, slot, 1))
    return runs


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its raw bytes (same shape): PyTorch has no CPU index_copy_ for FP8, and a
    tier copy moves bytes anyway. Other caches as they are."""
    return cache.view(torch.uint8) if fp8.is_fp8(cache.dtype) else cache


class HostKVCache:
    def __init__(self, num_slots: int, cache: torch.Tensor) -> None:
        shape = [num_slots, *cache.shape[:2], *cache.shape[3:]]
        self.device = cache.device
        self.on_gpu = cache.device.type == "cuda"
        # Allocated once, for the engine's life: pinned (every page faulted in) for the GPU's
        # copies; on a CPU its pages arrive as the tier first writes them.
        self.host = (torch.zeros(shape, dtype=cache.dtype, pin_memory=True) if self.on_gpu
                     else lazily_zeroed(shape, cache.dtype))
        self.block_bytes = self.host[0].numel() * self.host.element_size()
        self.counters = OffloadCounters()
        if self.on_gpu:
            self.stream = torch.cuda.Stream(cache.device)
            self._pending_timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def num_slots(self) -> int:
        return self.host.shape[0]

    def run(self, cache: torch.Tensor, copies: TierCopies) -> None:
        """Do a step's copies between ``cache`` and the host tier: demotions, then promotions."""
        if self.on_gpu:
            self._collect_gpu_timing()
        if copies.demote:
            started = time.perf_counter()
            blocks = [b for b, _ in copies.demote]
            slots = [s for _, s in copies.demote]
            if self.on_gpu:
                self._demote_gpu(cache, blocks, slots)
            else:
                as_bytes(self.host).index_copy_(
                    0, torch.tensor(slots, dtype=torch.long),
                    as_bytes(cache).index_select(2, torch.tensor(blocks, dtype=torch.long)).movedim(2, 0))
            self.counters.seconds_down += time.perf_counter() - started
            self.counters.bytes_down += len(blocks) * self.block_bytes
        if copies.promote:
            started = time.perf_counter()
            slots = [s for s, _ in copies.promote]
            blocks = [b for _, b in copies.promote]
            self.counters.bytes_up += len(blocks) * self.block_bytes
            if self.on_gpu:
                self._promote_gpu(cache, slots, blocks)  # timed by events, read next step
            else:
                as_bytes(cache).index_copy_(
                    2, torch.tensor(blocks, dtype=torch.long),
                    as_bytes(self.host).index_select(0, torch.tensor(slots, dtype=torch.long)).movedim(0, 2))
                self.counters.observe_restore(time.perf_counter() - started)

    # --- the GPU path -------------------------------------------------------------------
    def _demote_gpu(self, cache: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # after the kernels that wrote these blocks
        with torch.cuda.stream(self.stream):
            # Device tensors are made on the copy stream, so the allocator reuses their memory
            # only after these copies, never under a kernel of the compute stream.
            index = torch.tensor(blocks, dtype=torch.long).to(self.device)
            gathered = cache.index_select(2, index).movedim(2, 0).contiguous()
            read = torch.cuda.Event()
            read.record(self.stream)
            for position, slot, length in slot_runs(slots):
                self.host[slot : slot + length].copy_(gathered[position : position + length], non_blocking=True)
        # This step may hand the demoted blocks out and write them: only the gather must be done.
        compute.wait_event(read)

    def _promote_gpu(self, cache: torch.Tensor, slots: list[int], blocks: list[int]) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # earlier readers of these blocks are done with them
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            index = torch.tensor(blocks, dtype=torch.long).to(self.device)
            landed = torch.empty((len(slots), *self.host.shape[1:]), dtype=cache.dtype, device=self.device)
            for position, slot, length in slot_runs(slots):
                landed[position : position + length].copy_(self.host[slot : slot + length], non_blocking=True)
            cache.index_copy_(2, index, landed.movedim(0, 2))
            end.record(self.stream)
        compute.wait_event(end)  # the forward reads the promoted blocks only after they landed
        self._pending_timing = (start, end)

    def _collect_gpu_timing(self) -> None:
        if self._pending_timing is None:
            return
        start, end = self._pending_timing
        end.synchronize()
        self.counters.observe_restore(start.elapsed_time(end) / 1000)
        self._pending_timing = None
