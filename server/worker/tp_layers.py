"""The collectives a tensor-parallel rank's model adds to the single-device code.

A rank's model is the family's own module built from its shard's spec (tp_shard.py), so its
attention and MLP run unchanged on its heads and its share of the intermediate dimension; three
wrappers, put around modules after the load, join the ranks:

- the o and down projections (row-parallel) all-reduce their partial sums: two collectives a layer
  (a mixture-of-experts block all-reduces once, after adding its experts' partial products);
- the embedding looks up the ids in its vocabulary rows, zeroes the rest and all-reduces;
- the LM head computes its vocabulary rows' logits and all-gathers them, every rank getting the
  whole row (a gather to rank 0 would do, but NCCL and gloo both have all-gather, and logits rows
  are few: the last token of each sequence).

The LM head stays vocab-parallel rather than replicated: replicated, each rank would hold the
whole [vocab, hidden] matrix (a third of SmolLM2-135M's weights), which slicing at load avoids.
The one-call CPU layers (cpu_step_layers.py) call the projections directly, not these wrappers,
so a rank's model always takes the per-layer path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvscale.server.worker.moe import SparseMoeBlock


class AllReduceAfter(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:
        weight = self.inner.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows ``start .. start + rows - 1`` of the embedding; a token's row comes from its rank."""

    def __init__(self, inner: nn.Embedding, start: int) -> None:
        super().__init__()
        self.inner = inner
        self.start = start

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.inner.weight.shape[0])
        out = self.inner(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into whole rows (padding cut off)."""

    def __init__(self, inner: nn.Module, vocab_size: int, world_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.world_size = world_size

    @property
    def weight(self) -> torch.Tensor:
        weight = self.inner.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def join_ranks(model: nn.Module, vocab_size: int, vocab_start: int, world_size: int) -> None:
    """Wrap a loaded shard's modules with the collectives that make the ranks one model."""
    for layer in model.layers:  # type: ignore[union-attr]
        layer.self_attn.o_proj = AllReduceAfter(layer.self_attn.o_proj)
        if isinstance(layer.mlp, SparseMoeBlock):
            # Every rank routes alike (the router is whole, its input the same); the block's
            # output sums its experts' partial products, so one all-reduce closes it.
            layer.mlp = AllReduceAfter(layer.mlp)
        else:
            layer.mlp.down_proj = AllReduceAfter(layer.mlp.down_proj)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, vocab_start)  # type: ignore[arg-type]
    model.lm_head = VocabParallelHead(model.lm_head, vocab_size, world_size)  # type: ignore[arg-type]
    # The one-call CPU path would skip the wrappers: never take it on a rank.
    model._cpu_step_layers = None  # type: ignore[assignment]
    model._cpu_step_layers_checked = True  # type: ignore[assignment]
