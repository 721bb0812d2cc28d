"""What one tensor-parallel rank holds: its heads, its KV heads, its slice of the MLP and the
vocabulary, and the checkpoint's weights cut to those slices as they are read.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads and its
share of the intermediate dimension), o and down are row-parallel (each rank's partial sum is
all-reduced: once per attention block, once per MLP); the embedding and the LM head split the
vocabulary. The decisions are pure functions of the shapes, so they are unit-tested alone.

A family's own pieces follow the same split: gpt-oss's attention sinks (one per query head) go
with their heads; its experts' biases go with their outputs' rows (gate|up), and the row-parallel
down projection's bias, like o's, is held by rank 0 alone (added once after the sum, not N times).
Experts stacked as ``[experts, ...]`` tensors (transformers' own format, gpt-oss's only one) are
cut along each expert's intermediate dimension as they are read. gpt-oss's MXFP4 experts are cut
the same way before they are decoded, each rank decoding its slices alone: gate|up's blocks by
their output rows; down's 32-value blocks run along its input, the intermediate dimension, so a
rank whose share is not whole blocks (gpt-oss's 2880 over 4 ranks: 720) reads the blocks that
cover it, decodes them here and keeps its rows (mxfp4_covering_blocks).

KV heads: with a multiple of the ranks' count, each rank holds its own contiguous share. With
fewer, or a count the ranks do not divide, a rank holds the KV heads its query heads read,
repeated where needed so that every rank holds as many (one shape for every rank's model and
cache): the fewest such that consecutive equal groups of a rank's query heads share one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvscale.server.worker.mxfp4 import BLOCK as MXFP4_BLOCK
from kvscale.server.worker.mxfp4 import decode_experts, is_mxfp4_tensor

# Families whose layers tp_layers.py knows how to split; the others are refused at N > 1.
TENSOR_PARALLEL_MODEL_TYPES = ("gemma3_text", "gpt_oss", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3",
                               "qwen3_moe")


def local_kv_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    """The global KV head behind each of rank ``rank``'s local KV heads, in order. Every rank
    holds as many (its model and its cache have one shape), the fewest that serve all ranks."""
    per_rank = num_heads // size
    group = num_heads // num_kv_heads  # query heads per KV head

    def heads_of(r: int, count: int) -> list[int] | None:
        share = per_rank // count  # local query heads per local KV head
        first = r * per_rank
        heads = [(first + j * share) // group for j in range(count)]
        fits = all((first + q) // group == heads[q // share] for q in range(per_rank))
        return heads if fits else None

    for count in range(1, per_rank + 1):
        if per_rank % count == 0 and all(heads_of(r, count) is not None for r in range(size)):
            found = heads_of(rank, count)
            assert found is not None
            return found
    raise AssertionError("unreachable: one KV head per query head always fits")


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """This rank's first vocabulary row and how many rows every rank holds (the last one's tail
    zero-padded, so the shards gather into one evenly sized tensor)."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


def tensor_parallel_refusal(size: int, model_type: str | None, spec: Any, *, quantization: str | None) -> str | None:
    """Why ``size`` ranks cannot serve this model with these settings; None if they can."""
    if size == 1:
        return None
    if model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        return (f"model type {model_type!r} is not supported with tensor parallel yet (supported: "
                f"{', '.join(TENSOR_PARALLEL_MODEL_TYPES)})")
    if spec.moe is not None and spec.moe.intermediate_size % size:
        return (f"tensor_parallel_size {size} does not divide the experts' intermediate size "
                f"{spec.moe.intermediate_size}")
    if spec.num_heads % size:
        return (f"tensor_parallel_size {size} does not divide the model's {spec.num_heads} query heads")
    if (spec.moe is None or len(spec.moe.layers) < spec.num_layers) and spec.intermediate_size % size:
        return (f"tensor_parallel_size {size} does not divide the model's intermediate size "
                f"{spec.intermediate_size}")
    if quantization is not None:
        return f"--quantization {quantization} is not supported with tensor parallel yet"
    return None


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``: which rows and columns of each weight it reads."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    expert_intermediate_size: int = 0  # each expert's, in a mixture-of-experts model
    # gpt-oss's stacked experts: gate_up [experts, hidden, 2 * intermediate], gate and up
    # interleaved; down [experts, intermediate, hidden]. Otherwise (transformers' Mixtral and
    # Qwen3-MoE) gate_up [experts, 2 * intermediate, hidden], gate then up; down [experts, hidden,
    # intermediate].
    experts_in_out: bool = False

    @classmethod
    def for_spec(cls, spec: Any, rank: int, size: int) -> ShardPlan:
        from kvscale.server.worker.model_gpt_oss import GptOssSpec

        return cls(rank, size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size,
                   spec.vocab_size, spec.moe.intermediate_size if spec.moe is not None else 0,
                   isinstance(spec, GptOssSpec))

    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> list[int]:
        return local_kv_heads(self.num_heads, self.num_kv_heads, self.size, self.rank)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    def shard_spec(self, spec: Any) -> Any:
        """The spec of the smaller model this rank runs (the model code is the same): each
        expert keeps its router and splits its intermediate dimension as a dense MLP does."""
        moe = spec.moe and dataclasses.replace(spec.moe, intermediate_size=self.expert_intermediate_size // self.size)
        return dataclasses.replace(spec, num_heads=self.heads, num_kv_heads=len(self.kv_heads),
                                   intermediate_size=self.intermediate, moe=moe,
                                   vocab_size=vocab_shard(self.vocab_size, self.size, self.rank)[1])

    def _intermediate_rows(self, name: str) -> tuple[int, int, int]:
        """This rank's rows of an MLP's intermediate dimension: (first, end, the whole width)."""
        width = self.expert_intermediate_size if ".experts." in name else self.intermediate_size
        share = width // self.size
        return self.rank * share, (self.rank + 1) * share, width

    def row_ranges(self, name: str) -> list[tuple[int, int]] | None:
        """Rows (dim 0) of checkpoint weight ``name`` this rank reads; None: not split by rows."""
        hd = self.head_dim
        q_rows = (self.rank * self.heads * hd, (self.rank + 1) * self.heads * hd)
        kv_rows = [(h * hd, (h + 1) * hd) for h in self.kv_heads]
        first, end, width = self._intermediate_rows(name)
        i_rows = (first, end)
        if ".q_proj." in name:
            return [q_rows]
        if name.endswith(".self_attn.sinks"):  # gpt-oss: one per query head
            return [(self.rank * self.heads, (self.rank + 1) * self.heads)]
        if ".k_proj." in name or ".v_proj." in name:
            return kv_rows
        if ".qkv_proj." in name:  # Phi-3: q|k|v fused in the checkpoint
            q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
            return ([q_rows] + [(q_size + a, q_size + b) for a, b in kv_rows]
                    + [(q_size + kv_size + a, q_size + kv_size + b) for a, b in kv_rows])
        if ".gate_proj." in name or ".up_proj." in name or name.endswith((".w1.weight", ".w3.weight")):
            return [i_rows]  # w1, w3: Mixtral's experts' gate and up
        if ".gate_up_proj." in name:  # Phi-3: gate|up fused
            return [i_rows, (width + first, width + end)]
        return None

    def column_range(self, name: str) -> tuple[int, int] | None:
        """Columns (dim 1) of a row-parallel weight this rank reads; None: not split by columns."""
        if name.endswith("o_proj.weight"):
            width = self.heads * self.head_dim
            return self.rank * width, (self.rank + 1) * width
        if name.endswith(("down_proj.weight", ".w2.weight")):
            first, end, _ = self._intermediate_rows(name)
            return first, end
        return None


def read_shard(path: Path, plan: ShardPlan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as rank ``plan.rank`` holds them, each read as its slices only
    (safetensors' slices read from the file's mapping: no rank ever holds a full copy)."""
    from safetensors import safe_open

    from kvscale.server.worker.model_loader import checkpoint_files

    files = checkpoint_files(path)
    if not files:
        raise FileNotFoundError(f"tensor parallel reads *.safetensors weights; none in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():
                part = _read_slice(opened.get_slice(name), name, plan)
                weights[name] = part if is_mxfp4_tensor(name) else part.to(dtype)  # decoded by the model
    for name in [n for n in weights if n.endswith(".experts.down_proj_blocks")]:
        first, end, _ = plan._intermediate_rows(name)
        if first % MXFP4_BLOCK or end % MXFP4_BLOCK:
            # Part blocks at its edges: decoded here, the rank's rows kept (transformers' layout).
            start = mxfp4_covering_blocks(first, end)[0] * MXFP4_BLOCK
            stacked = name.removesuffix("_blocks")
            decoded = decode_experts(weights.pop(name), weights.pop(stacked + "_scales"), dtype)
            weights[stacked] = decoded[:, first - start:end - start].contiguous()
    return weights


def mxfp4_covering_blocks(first: int, end: int) -> tuple[int, int]:
    """The MXFP4 blocks (first, end) holding intermediate rows ``first:end``: one rank's share
    may begin or end inside a block, which its neighbour reads as well."""
    return first // MXFP4_BLOCK, -(-end // MXFP4_BLOCK)


def _stacked_experts_slice(tensor: Any, name: str, plan: ShardPlan) -> torch.Tensor:
    """This rank's share of each expert in a stacked ``[experts, ...]`` tensor."""
    first, end, width = plan._intermediate_rows(name)
    kind = name.rsplit(".", 1)[1]
    if plan.experts_in_out:
        if kind in ("gate_up_proj_blocks", "gate_up_proj_scales"):  # [experts, 2 * intermediate, ...]
            return tensor[:, 2 * first:2 * end]
        if kind in ("down_proj_blocks", "down_proj_scales"):  # [experts, hidden, intermediate / 32, ...]
            start, stop = mxfp4_covering_blocks(first, end)
            return tensor[:, :, start:stop]
        if kind == "gate_up_proj":  # gate and up interleaved: intermediate i is columns 2i, 2i + 1
            return tensor[:, :, 2 * first:2 * end]
        if kind == "gate_up_proj_bias":
            return tensor[:, 2 * first:2 * end]
        if kind == "down_proj":
            return tensor[:, first:end, :]
        if kind == "down_proj_bias":  # added once, after the sum: by rank 0 alone
            full = tensor[:]
            return full if plan.rank == 0 else torch.zeros_like(full)
    elif kind == "gate_up_proj":
        return torch.cat([tensor[:, first:end], tensor[:, width + first:width + end]], dim=1)
    elif kind == "down_proj":
        return tensor[:, :, first:end]
    if is_mxfp4_tensor(name):
        raise ValueError(f"checkpoint tensor {name!r} holds MXFP4 experts: kvscale decodes gpt-oss's alone")
    raise ValueError(f"stacked expert tensor {name!r}: no rule splits it over tensor-parallel ranks")


def _read_slice(tensor: Any, name: str, plan: ShardPlan) -> torch.Tensor:
    if ".experts." in name and not name.endswith((".weight", ".bias")):  # [experts, ...] stacked
        return _stacked_experts_slice(tensor, name, plan)
    rows = plan.row_ranges(name)
    if rows is not None:
        return torch.cat([tensor[a:b] for a, b in rows])
    columns = plan.column_range(name)
    if columns is not None:
        return tensor[:, columns[0]:columns[1]]
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        # A row-parallel bias is added once, after the all-reduce's sum: by rank 0 alone.
        full = tensor[:]
        return full if plan.rank == 0 else torch.zeros_like(full)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, count = vocab_shard(plan.vocab_size, plan.size, plan.rank)
        part = tensor[start:min(start + count, plan.vocab_size)]
        if part.shape[0] < count:
            part = torch.cat([part, part.new_zeros(count - part.shape[0], part.shape[1])])
        return part
    return tensor[:]
