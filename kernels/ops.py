"""The paged-KV ops, each signature written once, and the backend type that implements them.

An op is a Protocol: its argument list and its contract. A backend (PyTorch reference, CPU,
Triton) is one :class:`KernelBackend` holding its function for each op; mypy checks every
function against the op's Protocol, names included, so the backends cannot drift apart. The
engine picks its backend once (:func:`kvscale.kernels.backend_for`) and calls its fields directly:
no dispatch, allocation or reflection per call.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``. Softmax runs in float32 whatever the cache dtype. An FP8
cache (``--kv-cache-dtype fp8*``) holds K and V divided by ``k_scale``/``v_scale``
(:mod:`kvscale.kernels.fp8` has the exact semantics); other caches ignore the scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


class WriteKV(Protocol):
    def __call__(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
        *, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots in
        place. A slot of -1 means "don't store" (e.g. a token whose KV is already cached)."""


class DecodeAttention(Protocol):
    def __call__(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> Tensor:
        """Attention of one new token per sequence over its whole paged context.

        ``query`` ``[num_seqs, num_heads, head_dim]``; ``block_tables`` ``[num_seqs, max_blocks]``
        (padding entries are ignored); ``context_lens`` ``[num_seqs]`` counts the cached tokens
        including the new one (0: a padding sequence, whose output is zeros). Returns
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
        """


class PrefillAttention(Protocol):
    def __call__(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        query_start_loc: Tensor,
        context_lens: Tensor,
        scale: float,
        *,
        max_query_len: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> Tensor:
        """Causal attention of a ragged batch of new tokens over their paged contexts.

        ``query`` ``[num_tokens, num_heads, head_dim]`` concatenates the new tokens of every
        sequence; ``query_start_loc`` ``[num_seqs + 1]`` holds their cumulative offsets. The new
        tokens of sequence i are the last ``q_len_i`` of its ``context_lens[i]`` cached tokens
        (their KV already written), and the query at position p sees keys 0..p. This covers a
        whole prompt, a chunk after a cached prefix, and a decode token (q_len 1) alike.
        ``max_query_len`` (the longest sequence's new tokens, known to the engine on the host)
        spares a backend that needs it a read-back from the device.
        """


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """One implementation of every op; the model calls the fields as functions."""

    name: str
    write_kv: WriteKV
    paged_decode_attention: DecodeAttention
    paged_prefill_attention: PrefillAttention
    # Whether paged_prefill_attention gives a mixed batch's single-token sequences to the decode
    # op itself; where it does not (Triton: each would take a whole query tile), the runner
    # splits such batches in two (``DecodePrefillSplit``).
    prefill_batches_decodes: bool


__all__ = ["WriteKV", "DecodeAttention", "PrefillAttention", "KernelBackend"]
