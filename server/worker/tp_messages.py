"""What rank 0 sends the other tensor-parallel ranks, and how a rank applies it (tp_group.py's
pipes, tp_nodes.py's connections to other nodes, relayed by tp_headless.py).

Each message is a pickled tuple whose first element is its kind. Rank 0 sends it before doing
the same thing itself, on one ordered channel per rank, so every rank's KV cache (and host tier)
goes through the same allocations and copies in the same order as rank 0's, each on its own
heads:

- ``("alloc", num_blocks, max_model_len, num_window_blocks, groups)``: the KV cache and the RoPE
  tables; with ``groups`` (kv_groups.py) the full group's cache of ``num_blocks`` blocks and the
  sliding-window layers' of ``num_window_blocks`` (docs/engine.md, "Sliding-window layers' KV
  blocks"), whose pool and freeing stay in rank 0's scheduler;
- ``("host_alloc", num_slots)``: the host KV tier's slots (docs/engine.md, "The second KV tier"),
  each a block of this rank's heads;
- ``("tiers", TierCopies)``: a step's demotions and promotions, before its block copies and
  forward (the engine's order, llm_engine.py);
- ``("copy", [(src, dst), ...])``: copy-on-write block copies; ``("window_copy", ...)`` the same
  in the window group's cache;
- ``("forward", ids, positions, metadata, logits_indices)``: a pass, its collectives met by all;
  the metadata carries the window group's slots and tables too (``AttentionMetadata.window``);
- ``("stop",)``: the last one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.model_runner import ModelRunner


def _map_tensors(value: Any, move: Any) -> Any:
    """``value`` with ``move`` applied to every tensor in it, through nested dataclasses."""
    if isinstance(value, torch.Tensor):
        return move(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _map_tensors(getattr(value, f.name), move)
                                             for f in dataclasses.fields(value)})
    return value


def _with_kernels(meta: AttentionMetadata, kernels: Any) -> AttentionMetadata:
    """``meta`` and its window group's (if any) with ``kernels``."""
    window = None if meta.window is None else _with_kernels(meta.window, kernels)
    return dataclasses.replace(meta, kernels=kernels, window=window)


def portable(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata without its kernel backend (each rank has its own), on the host."""
    moved: AttentionMetadata = _map_tensors(_with_kernels(meta, None), torch.Tensor.cpu)
    return moved


def _on_device(meta: AttentionMetadata, device: torch.device, kernels: Any) -> AttentionMetadata:
    return _with_kernels(_map_tensors(meta, lambda t: t.to(device)), kernels)


@torch.inference_mode()
def apply_message(runner: ModelRunner, message: tuple[Any, ...]) -> bool:
    """Run one of rank 0's messages on this rank; False for the last one."""
    model = runner.model
    kind = message[0]
    if kind == "stop":
        return False
    if kind == "alloc":
        # Not allocate_kv_cache: its GPU warm-up is rank 0's, mirrored pass by pass.
        num_blocks, max_model_len, num_window_blocks, runner.groups = message[1:]
        runner.kv_cache, runner.kv_caches = runner._new_kv_cache(num_blocks, num_window_blocks or None)
        model.build_rope_cache(max_model_len)
        runner.num_blocks, runner.max_model_len = num_blocks, max_model_len
        runner.num_window_blocks = num_window_blocks
    elif kind == "host_alloc":
        runner.allocate_host_cache(message[1])
    elif kind == "tiers":
        runner.move_between_tiers(message[1])
    elif kind == "copy":
        runner.copy_blocks(message[1])
    elif kind == "window_copy":
        runner.copy_window_blocks(message[1])
    elif kind == "forward":
        ids, positions, meta, logits_indices = message[1:]
        device = runner.device
        hidden = model.hidden_states(ids.to(device), positions.to(device), runner.kv_caches,
                                     _on_device(meta, device, runner.kernels), logits_indices.to(device))
        model.compute_logits(hidden)  # joins the head's all-gather; rank 0 samples
    else:
        raise ValueError(f"unknown tensor-parallel message {kind!r}")
    return True
