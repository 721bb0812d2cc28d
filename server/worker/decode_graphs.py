"""Pure-decode steps replayed as CUDA graphs: one graph per batch size of a ladder, captured at start.

Eager, a decode step of a small model is bound by the host launching ~15 kernels per layer from
Python (docs/performance.md, "GPU: the decode step and the kernels": the bundled model's step
shapes take ~13 ms eager and ~2 ms replayed on an H200). A graph replays every launch of the
forward at once. Only pure-decode steps are replayed (every sequence one new token, no prompt
logprobs); the batch is padded up to the next captured size, and the padded rows write no KV
(slot -1) and attend to nothing (context 0). The graphs end at the final norm's hidden states:
the logits are computed eagerly after the replay, since each graph keeps its output buffer for
its whole life and ``[batch, vocab]`` buffers for every size would hold hundreds of megabytes.

The inputs live in static buffers that every graph reads; a replay first copies the step's
inputs into them. The kernels take their launch shape from tensor shapes only (the block table's
width, the batch size), never from a device read-back, which is what makes them capturable.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import partial

import torch

from kvscale.kernels import KernelBackend
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.model_llama import DecoderForCausalLM

Replay = Callable[[], torch.Tensor]
# Turns a forward over the static buffers into something that reruns it: on a GPU a CUDA graph
# captured from it (cuda_graph_capture); the tests rerun the forward itself on CPU.
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def why_not_captured(model: DecoderForCausalLM) -> str | None:
    """Why ``model``'s decode steps cannot be captured as graphs, or None where they can."""
    if model.spec.moe is not None:
        return ("its mixture-of-experts layers read each expert's row count back to the host to size "
                "the expert's work (server/worker/moe.py), which a CUDA graph cannot hold")
    return model.graph_capture_blocker


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (included)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows (None: more than the largest)."""
    at = bisect.bisect_left(sizes, num_seqs)
    return sizes[at] if at < len(sizes) else None


def cuda_graph_capture(device: torch.device) -> Capture:
    """Capture on ``device``, every graph in one memory pool (the largest first, so the others
    reuse its memory)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> Replay:
        # Once eagerly first: lazy set-up (cuBLAS workspaces, Triton launchers) must not be captured.
        forward()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kernels: KernelBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: Capture,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kernels = kernels
        self.sizes = capture_sizes(max_num_seqs)
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(rows, dtype=torch.long, device=device)
        self._replays: dict[int, Replay] = {}
        for size in reversed(self.sizes):
            self._replays[size] = capture(partial(self._forward, size))

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            is_decode=True,
            kernels=self.kernels,
            max_query_len=1,
        )
        return self.model.hidden_states(self.input_ids[:size], self.positions[:size], self.kv_caches, meta,
                                        self.rows[:size])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states of a pure-decode step, one row per sequence in order, from a
        replay; None where no graph fits (more sequences than captured, a wider block table).
        The rows are a view of a graph's buffer: valid until the next replay."""
        num_seqs = input_ids.shape[0]
        size = padded_size(self.sizes, num_seqs)
        width = meta.block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        self.context_lens[num_seqs:size].zero_()
        # Columns past `width` keep an earlier step's entries: no kernel reads past a context.
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        return self._replays[size]()[:num_seqs]
