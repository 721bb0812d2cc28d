"""The passes a runner makes before it serves: the largest step profiled for the KV pool's size,
and a prefill, a mixed and a decode pass that build (or load) every kernel a first request takes.

Both run on scratch KV blocks and leave nothing behind (kv_sizing.py sizes the pool from the
profile; the engine core warms up before it says it is ready, docs/server.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.outputs import RequestMetrics
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.memory_profile import MemoryMeter
from kvscale.server.worker.sampler import Sampler, SamplingRow, make_generator

if TYPE_CHECKING:
    from kvscale.server.worker.model_runner import ModelRunner


@dataclass
class StepProfile:
    """What the profiling pass ran and what it added to memory at its peak."""

    num_tokens: int
    num_seqs: int
    peak_bytes: int | None  # None: this platform offers no way to measure it
    seconds: float  # how long the pass took (start-up time it costs)



@torch.inference_mode()
def profile_step(runner: ModelRunner, lengths: list[int], sampler: Sampler) -> StepProfile:
    """Run the largest step once on a throwaway KV cache and measure the memory it adds.

    One prompt of ``lengths[i]`` tokens per sequence, every row's logits computed (each
    request asks for prompt logprobs: the worst case), the engine's log-softmax over them,
    then the sampler's full host path (temperature, top-k/p, min-p, penalties, min_tokens,
    logprobs) on the sampling rows. The scratch cache is allocated before the meter starts,
    since the real cache is accounted for block by block. Nothing outlives the call: the
    runner's own cache (if any) is put back untouched and every tensor of the pass is freed.
    """
    bs = runner.block_size
    vocab = runner.model.spec.vocab_size
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=0.5, min_tokens=1, max_tokens=1,
        logprobs=20, prompt_logprobs=20,
    )
    scheduled: list[ScheduledSeq] = []
    num_blocks = 0
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", None, [], params, None, RequestMetrics(0.0), 1)
        seq = Sequence(request, 0, [(num_blocks * bs + k) % vocab for k in range(n)], n)
        seq.block_table = list(range(num_blocks, num_blocks + -(-n // bs)))
        num_blocks += len(seq.block_table)
        scheduled.append(ScheduledSeq(seq, n))
    runner.model.build_rope_cache(max(lengths))
    own = runner.kv_cache, runner.kv_caches
    own_window = runner.window_cache  # a window group's (server/worker/kv_groups.py), replaced too
    runner.kv_cache, runner.kv_caches = runner._new_kv_cache(num_blocks)
    # Written now, so its pages are resident before the meter starts: a CPU cache's pages
    # otherwise arrive as the pass first writes them, and would count in its peak.
    runner.kv_cache.zero_()
    started = time.perf_counter()
    try:
        with MemoryMeter(runner.device) as meter:
            step = runner.execute(scheduled, [])
            if step.prompt_rows:
                torch.log_softmax(step.prompt, dim=1)  # as the engine records prompt logprobs
            rows = [
                SamplingRow(params, scheduled[i].seq.token_ids, lengths[i], make_generator(0, i))
                for i in step.sample_rows
            ]
            sampler(step.sample, rows)
            del step
    finally:
        runner.kv_cache, runner.kv_caches = own
        runner.window_cache = own_window
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    return StepProfile(sum(lengths), len(lengths), meter.peak_bytes, time.perf_counter() - started)

@torch.inference_mode()
def warm_up_passes(runner: ModelRunner, num_tokens: int = 40) -> None:
    """Run a prefill, a mixed and a decode forward pass on scratch KV blocks.

    No block belongs to any sequence yet and nothing is registered by hash, so the garbage
    written into the first blocks is overwritten before anyone reads them.
    """
    bs = runner.block_size
    num_tokens = max(2, min(num_tokens, runner.max_model_len - 1, runner.num_blocks * bs - 1))
    table = list(range(-(-(num_tokens + 1) // bs)))
    device = runner.device

    def forward(chunks: list[tuple[int, int]]) -> None:
        # Every chunk is (first position, count) of one sequence that owns `table`.
        ids, pos, lens, starts = [], [], [], [0]
        for first, count in chunks:
            ids += [0] * count
            pos += list(range(first, first + count))
            lens.append(first + count)
            starts.append(starts[-1] + count)
        positions = torch.tensor(pos, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos], device=device),
            block_tables=torch.tensor([table] * len(chunks), dtype=torch.int32, device=device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            is_decode=all(count == 1 for _, count in chunks),
            kernels=runner.kernels,
            max_query_len=max(count for _, count in chunks),
        )
        last = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long, device=device)
        logits = runner.model(torch.tensor(ids, device=device), positions, runner.kv_caches, meta, last)
        logits.argmax(dim=1).tolist()

    forward([(0, num_tokens)])  # prefill
    forward([(num_tokens - 1, 1), (0, num_tokens // 2)])  # a decode inside a prefill batch
    forward([(num_tokens, 1), (num_tokens - 1, 1)])  # pure decode
    if device.type == "cuda":
        torch.cuda.synchronize(device)
