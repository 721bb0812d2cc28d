"""Sliding-window attention over the paged KV cache, in PyTorch: a query at position p sees the
keys at positions p - window < k <= p, as transformers' sliding-window mask has it
(``masking_utils.sliding_window_overlay``). Gemma 3's local layers run it on every backend; the
C and Triton kernels attend causally over the whole context and have no window (docs/engine.md,
"The model"). gpt-oss runs every layer here, its full-attention ones too (``window`` None): each
head's learned sink logit joins the softmax's denominator, which the kernels cannot add.

Each sequence gathers only the blocks its queries' windows reach, so a decode reads about
``window`` keys however long the sequence. The blocks before the window go back to the window
group's pool as the sequence advances (server/core/window_group.py), where the model has one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscale.kernels.reference import widened
from kvscale.server.worker.attention_metadata import AttentionMetadata


def paged_window_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None, *, k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query`` ``[num_tokens, num_heads, head_dim]``, this step's tokens of every sequence
    (``meta.query_start_loc``), each sequence's keys already written; the same shape back.

    ``window`` None: causal over the whole context. ``sinks`` ``[num_heads]``: a logit per head
    in the softmax's denominator with no value (transformers' gpt-oss ``eager_attention_forward``)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    starts = meta.query_start_loc.tolist()
    lens = meta.context_lens.tolist()
    table = meta.block_tables.to(device=k_cache.device, dtype=torch.long)
    k_rows = k_cache.view(num_blocks, -1)
    v_rows = v_cache.view(num_blocks, -1)
    out = query.new_zeros(query.shape)
    for i, ctx in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if not q_len or not ctx:
            continue
        # The earliest key any of these queries sees.
        first = 0 if window is None else max(0, ctx - q_len - window + 1)
        first_block = first // block_size
        blocks = table[i, first_block: -(-ctx // block_size)]
        lo, hi = first - first_block * block_size, ctx - first_block * block_size
        keys = widened(k_rows.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[lo:hi], k_scale)
        values = widened(v_rows.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[lo:hi], v_scale)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        k_pos = torch.arange(first, ctx, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        q = query[starts[i]: starts[i + 1]].float().transpose(0, 1)  # [H, q_len, D]
        if sinks is None:
            seq_out = F.scaled_dot_product_attention(
                q[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask[None, None],
                scale=scale, enable_gqa=num_kv_heads != query.shape[1],
            )[0]
        else:
            seq_out = _attend_with_sinks(q, keys.transpose(0, 1), values.transpose(0, 1), mask, scale, sinks)
        out[starts[i]: starts[i + 1]] = seq_out.transpose(0, 1).to(query.dtype)
    return out


def _attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """``q`` ``[H, q_len, D]``, ``keys``/``values`` ``[kv_heads, k_len, D]`` in float32: the softmax
    over the keys and one more logit per head whose probability is dropped, so the weights a
    query gives its keys sum to less than one."""
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, q.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values)
