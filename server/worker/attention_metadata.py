"""What one step's attention needs besides the tokens: how the flattened batch maps onto
sequences and KV slots, and which kernels run it. The runner builds it, every layer reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscale.kernels import KernelBackend


@dataclass
class AttentionMetadata:
    """How this step's flattened tokens map onto sequences and KV slots (built by the runner)."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32, including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    is_decode: bool  # every sequence contributes exactly one token
    kernels: KernelBackend  # the runner's, picked once for its device
    max_query_len: int = 1  # the longest sequence's new tokens, known on the host (no device read-back)
    split: DecodePrefillSplit | None = None  # mixed batches, where the kernels want them cut
    # The window layers' own slots and tables, where the KV cache has a window group (kv_groups.py).
    window: AttentionMetadata | None = None


@dataclass
class DecodePrefillSplit:
    """A mixed batch cut in two for kernels whose prefill does not batch decodes (Triton):
    single-token sequences go to the decode kernel instead of occupying a whole query tile of
    the prefill kernel each."""

    decode_rows: torch.Tensor  # [num_decode] long: their tokens' rows in the flattened batch
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_rows: torch.Tensor  # [num_prefill_tokens] long
    prefill_block_tables: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
