"""The KV cache split by attention kind: the full-attention layers' group and one sliding-window
group, each with its own tensor, block count and per-sequence block table (docs/engine.md,
"Sliding-window layers' KV blocks"; the blocks themselves are server/core/window_group.py's).

A model gets a window group where its layers mix full attention with one window size (Gemma 3,
gpt-oss): the window layers then hold about ``window`` tokens a sequence instead of its whole
length. A model with no window layers, or whose every layer has the window (Mistral and Phi-3,
whose length the engine caps at the window), keeps one group, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from kvscale.server.core.block_table_rows import BlockTableRows
from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.core.zeroed_memory import lazily_zeroed
from kvscale.server.worker.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class KVGroups:
    window: int
    full_layers: tuple[int, ...]
    window_layers: tuple[int, ...]


def kv_groups(layer_windows: Seq[int | None]) -> KVGroups | None:
    """The two groups of a model whose layers' windows are ``layer_windows`` (None: full
    attention), or None where one group serves it (no window layer, only window layers, or
    windows of more than one size)."""
    windows = {w for w in layer_windows if w is not None}
    if len(windows) != 1 or None not in layer_windows:
        return None
    full = tuple(i for i, w in enumerate(layer_windows) if w is None)
    return KVGroups(windows.pop(), full, tuple(i for i, w in enumerate(layer_windows) if w is not None))


def group_block_bytes(groups: KVGroups, per_layer_block_bytes: int) -> tuple[int, int]:
    """Bytes of one block of the full group and of the window group (K and V of their layers)."""
    return len(groups.full_layers) * per_layer_block_bytes, len(groups.window_layers) * per_layer_block_bytes


def split_budget(budget_bytes: int, full_block_bytes: int, window_block_bytes: int, window_blocks_wanted: int,
                 min_window_blocks: int) -> tuple[int, int]:
    """(full blocks, window blocks) in ``budget_bytes``: the window group gets what
    ``max_num_seqs`` sequences hold at once (``window_blocks_wanted``), never more than half the
    budget nor fewer than one sequence's step needs (``min_window_blocks``); the full group the rest."""
    half = budget_bytes // 2 // window_block_bytes
    window = max(min_window_blocks, min(window_blocks_wanted, half))
    return max(budget_bytes - window * window_block_bytes, 0) // full_block_bytes, window


def new_group_caches(groups: KVGroups, num_blocks: int, num_window_blocks: int, block_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, device: torch.device,
                     ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The full group's cache, the window group's, and each layer's (K, V) views in layer order."""
    def one(layers: int, blocks: int) -> torch.Tensor:
        shape = (layers, 2, blocks, block_size, num_kv_heads, head_dim)
        if device.type == "cpu":
            return lazily_zeroed(shape, dtype)  # as the one-group cache: nothing written at start-up
        return torch.zeros(shape, dtype=dtype, device=device)

    full, window = one(len(groups.full_layers), num_blocks), one(len(groups.window_layers), num_window_blocks)
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for cache, layers in ((full, groups.full_layers), (window, groups.window_layers)):
        for k, layer in enumerate(layers):
            views[layer] = (cache[k, 0], cache[k, 1])
    return full, window, [views[i] for i in range(len(views))]


def window_metadata(rows: BlockTableRows, scheduled: list[ScheduledSeq], meta: AttentionMetadata,
                    attn_rows: list[int] | None, to_device: Callable[[torch.Tensor], torch.Tensor],
                    ) -> AttentionMetadata:
    """``meta`` for the window layers: the same sequences, lengths and query starts, the window
    group's tables and KV slots (``attn_rows``: the table row each of attention's entries reads,
    None where that is one entry a sequence)."""
    if not any(item.seq.window_table for item in scheduled):
        return meta  # start-up passes (start_up_passes.py) run on the full group's table alone
    tables = rows.tables(scheduled)
    bs = rows.block_size
    lens = np.fromiter((item.num_new_tokens for item in scheduled), dtype=np.int64, count=len(scheduled))
    starts = np.fromiter((item.seq.num_computed_tokens for item in scheduled), dtype=np.int64, count=len(scheduled))
    first_row = np.cumsum(lens) - lens  # each sequence's first row in the flattened batch
    row = np.repeat(np.arange(len(scheduled)), lens)
    pos = np.repeat(starts - first_row, lens) + np.arange(int(lens.sum()))
    slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
    attn_tables = tables if attn_rows is None else tables[attn_rows]
    return dataclasses.replace(meta, slot_mapping=to_device(torch.from_numpy(slots)),
                               block_tables=to_device(torch.from_numpy(np.ascontiguousarray(attn_tables))),
                               split=None, window=None)


def group_pool_blocks(groups: KVGroups, num_blocks: int, per_layer_block_bytes: int, *, overridden: bool,
                      max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> tuple[int, int]:
    """(full blocks, window blocks) where one group of ``num_blocks`` blocks of every layer was
    sized; with ``overridden`` (--num-gpu-blocks-override) the full group keeps that count."""
    from kvscale.server.core.window_group import blocks_per_sequence

    full_bytes, window_bytes = group_block_bytes(groups, per_layer_block_bytes)
    least = blocks_per_sequence(groups.window, block_size, max_num_batched_tokens)
    wanted = max(least, max_num_seqs * blocks_per_sequence(groups.window, block_size)
                 + -(-max_num_batched_tokens // block_size))
    if overridden:
        return num_blocks, wanted
    budget = num_blocks * (full_bytes + window_bytes)
    full, window = split_budget(budget, full_bytes, window_bytes, wanted, least)
    if full < 1:
        raise ValueError(f"KV cache budget of {budget} bytes leaves no block for the full-attention layers once "
                         f"the sliding-window layers have {window} blocks")
    return full, window
