"""The second KV tier's memory and the copies between it and the KV cache.

The host tier is one tensor shaped like the KV cache, ``[layer, k|v, slot, offset, kv_head,
head_dim]``, allocated once when the engine starts: pinned when the cache is on a GPU, so the
copies are DMA, and plain memory on CPU. A step's copies run before its forward, in one batch
each way: demotions (cache → host) first, since a demoted block may be handed out again and
written by this very step, then promotions (host → cache).

On a GPU both directions run on a copy stream of their own, ordered by events, never by sleeps:
the copy stream waits for the compute stream (so it reads blocks only after the kernels that
wrote them), a demotion finishes before the host scatters it into its slots, and the compute
stream waits for the promotion's event before the forward reads the promoted blocks. The pinned
staging buffers are kept for the next step and reused only after the copy that used them ended.
On CPU the same two batches are plain ``index_select`` / ``index_copy_`` calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvscale.server.block_pool import TierCopies
from kvscale.server.kv_tier_policy import RESTORE_BUCKETS


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


class HostKVCache:
    def __init__(self, num_slots: int, cache: torch.Tensor) -> None:
        shape = list(cache.shape)
        shape[2] = num_slots
        self.device = cache.device
        self.on_gpu = cache.device.type == "cuda"
        # Allocated once, for the engine's life; zeros so the pages are the process's from now
        # on the GPU path (pinning faults them in) and lazily on CPU.
        self.host = torch.zeros(shape, dtype=cache.dtype, pin_memory=self.on_gpu)
        self.block_bytes = self.host[:, :, 0].numel() * self.host.element_size()
        self.counters = OffloadCounters()
        if self.on_gpu:
            self.stream = torch.cuda.Stream(cache.device)
            self._staging: torch.Tensor | None = None
            self._staging_free: torch.cuda.Event | None = None
            self._pending_timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def num_slots(self) -> int:
        return self.host.shape[2]

    def run(self, cache: torch.Tensor, copies: TierCopies) -> None:
        """Do a step's copies between ``cache`` and the host tier: demotions, then promotions."""
        if self.on_gpu:
            self._collect_gpu_timing()
        if copies.demote:
            started = time.perf_counter()
            blocks = [b for b, _ in copies.demote]
            slots = torch.tensor([s for _, s in copies.demote], dtype=torch.long)
            if self.on_gpu:
                self._demote_gpu(cache, blocks, slots)
            else:
                self.host.index_copy_(2, slots, cache.index_select(2, torch.tensor(blocks, dtype=torch.long)))
            self.counters.seconds_down += time.perf_counter() - started
            self.counters.bytes_down += len(blocks) * self.block_bytes
        if copies.promote:
            started = time.perf_counter()
            slots = torch.tensor([s for s, _ in copies.promote], dtype=torch.long)
            blocks = [b for _, b in copies.promote]
            self.counters.bytes_up += len(blocks) * self.block_bytes
            if self.on_gpu:
                self._promote_gpu(cache, slots, blocks)  # timed by events, read next step
            else:
                cache.index_copy_(2, torch.tensor(blocks, dtype=torch.long), self.host.index_select(2, slots))
                self.counters.observe_restore(time.perf_counter() - started)

    # --- the GPU path -------------------------------------------------------------------
    def _staging_for(self, n: int) -> torch.Tensor:
        """A pinned, contiguous ``[layer, k|v, n, ...]`` buffer for ``n`` blocks, free to overwrite
        (its last copy has ended). One flat buffer, grown by doubling and kept: a view of its
        prefix is contiguous, so the copies to and from the device stay asynchronous DMA."""
        if self._staging_free is not None:
            self._staging_free.synchronize()
            self._staging_free = None
        per_block = self.host[:, :, 0].numel()
        if self._staging is None or self._staging.numel() < n * per_block:
            have = self._staging.numel() // per_block if self._staging is not None else 0
            self._staging = torch.empty(max(n, 2 * have) * per_block, dtype=self.host.dtype, pin_memory=True)
        shape = list(self.host.shape)
        shape[2] = n
        return self._staging[: n * per_block].view(shape)

    def _demote_gpu(self, cache: torch.Tensor, blocks: list[int], slots: torch.Tensor) -> None:
        staging = self._staging_for(len(blocks))
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=False)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the writers
        with torch.cuda.stream(self.stream):
            staging.copy_(cache.index_select(2, index), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # The scatter into the host slots reads the staging buffer: the copy must have landed,
        # and the freed blocks are not written before the next forward is queued after this.
        done.synchronize()
        self.host.index_copy_(2, slots, staging)

    def _promote_gpu(self, cache: torch.Tensor, slots: torch.Tensor, blocks: list[int]) -> None:
        staging = self._staging_for(len(blocks))
        torch.index_select(self.host, 2, slots, out=staging)
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=False)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # earlier readers of these blocks are done with them
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            cache.index_copy_(2, index, staging.to(self.device, non_blocking=True))
            end.record(self.stream)
        compute.wait_event(end)  # the forward reads the promoted blocks only after they landed
        self._staging_free = end
        self._pending_timing = (start, end)

    def _collect_gpu_timing(self) -> None:
        if self._pending_timing is None:
            return
        start, end = self._pending_timing
        end.synchronize()
        self.counters.observe_restore(start.elapsed_time(end) / 1000)
        self._pending_timing = None
