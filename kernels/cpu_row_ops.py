"""The C kernels that work row by row, each in one pass where PyTorch takes several: the decoder
layer's elementwise steps (SiLU-and-multiply, residual add + RMSNorm, RoPE: cpu_layer_ops.c), a
row's int8 quantization and a GEMM output's rescale (cpu_quantize.c), and a structured output
step's token bitmask (cpu_token_mask.c). Each returns None (or False) where the C kernels do not
take its tensors, and the caller runs the PyTorch ops."""

from __future__ import annotations

import torch
from torch import Tensor

from kvscale.kernels.cpu_build import library

# Elements per thread below which a row op runs on one thread: PyTorch's own elementwise grain
# (at::internal::GRAIN_SIZE). A decode step's rows are a few thousand elements, microseconds of
# work, where waking a second thread costs as much, and a parallel region waits for its slowest
# thread: one descheduled by another process on a busy host stalls the whole op for its time slice.
ROW_OP_GRAIN = 32768


def threads_for(elements: int) -> int:
    """The threads a row op of ``elements`` gets: one per ``ROW_OP_GRAIN``, at most torch's."""
    return max(1, min(torch.get_num_threads(), elements // ROW_OP_GRAIN))


_DTYPES = (torch.float32, torch.bfloat16)


def _fits(*tensors: Tensor) -> bool:
    """Whether the C kernels take these tensors: on the CPU, contiguous, one of their dtypes.

    A plain loop over ``is_cpu``: a decode step calls this a few times per layer, and the
    generator over ``t.device.type`` (a new device object each time) was most of a row op's
    host time on one row."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or not t.is_contiguous():
            return False
    return True


def silu_and_mul(gate_up: Tensor) -> Tensor | None:
    """``silu(gate_up[..., :n]) * gate_up[..., n:]`` in one pass, or None where the C kernels
    do not apply (the caller then runs the PyTorch ops)."""
    lib = library()
    if lib is None or not _fits(gate_up):
        return None
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], width))
    lib.kvscale_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width,
                             int(gate_up.dtype == torch.bfloat16), threads_for(gate_up.numel()))
    return out


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor | None:
    """RMSNorm of ``x`` (or, given ``residual``, ``residual += x`` in place, then RMSNorm of it) in
    one pass; None where the C kernels do not apply."""
    lib = library()
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if lib is None or not _fits(*tensors) or (residual is not None and residual.shape != x.shape):
        return None
    width = x.shape[-1]
    out = torch.empty_like(x)
    lib.kvscale_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                             out.data_ptr(), x.numel() // width, width, eps, int(x.dtype == torch.bfloat16),
                             threads_for(x.numel()))
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` (heads contiguous within a token,
    tokens any stride apart: the q|k part of the fused qkv output) with each token's cos/sin row
    (``[tokens, head_dim]``, or ``[tokens, 1, head_dim]``); a new contiguous tensor, or None
    where the C kernels do not apply."""
    lib = library()
    tokens, heads, head_dim = x.shape
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if (lib is None or not _fits(cos, sin) or x.dtype != cos.dtype or not x.is_cpu
            or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2 or cos.shape[1] != head_dim):
        return None
    out = x.new_empty((tokens, heads, head_dim))
    lib.kvscale_rope(x.data_ptr(), x.stride(0), None, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                     out.data_ptr(), tokens, heads, head_dim, int(x.dtype == torch.bfloat16),
                     threads_for(tokens * heads * head_dim))
    return out


def quantize_rows_u8(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row of ``x`` ``[rows, width]`` quantized symmetrically to int8, stored +128 as uint8
    (cpu_quantize.c says why), and the float32 scale of each row; None where the C kernels do not
    apply."""
    lib = library()
    if lib is None or not _fits(x) or x.dim() != 2:
        return None
    rows, width = x.shape
    q = torch.empty((rows, width), dtype=torch.uint8)
    scales = torch.empty(rows, dtype=torch.float32)
    lib.kvscale_quantize_rows_u8(x.data_ptr(), rows, width, int(x.dtype == torch.bfloat16), q.data_ptr(),
                                 scales.data_ptr(), threads_for(x.numel()))
    return q, scales


def rescale_rows(y: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor | None:
    """``y * scales[:, None] + bias`` for ``y`` ``[rows, width]`` (float32 or bfloat16, a GEMM's
    fresh output), in place in one pass; None where the C kernels do not apply."""
    lib = library()
    if (lib is None or not _fits(y) or y.dim() != 2 or scales.dtype != torch.float32 or not scales.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    rows, width = y.shape
    is_bf16 = int(y.dtype == torch.bfloat16)
    lib.kvscale_rescale_rows(y.data_ptr(), is_bf16, scales.data_ptr(), None if bias is None else bias.data_ptr(), rows,
                             width, y.data_ptr(), is_bf16, threads_for(y.numel()))
    return y


def apply_token_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> bool:
    """-inf in place wherever row ``rows[i]`` of ``logits`` ``[n, vocab]`` has its token's bit 0 in
    ``bitmask[i]`` (int32 words, bit j of word w = token 32w + j; tokens past them are masked
    too); False, untouched, where the C kernels do not apply."""
    lib = library()
    if (lib is None or not _fits(logits) or logits.dim() != 2 or bitmask.dtype != torch.int32
            or not bitmask.is_contiguous() or bitmask.shape[0] != len(rows)):
        return False
    index = torch.tensor(rows, dtype=torch.int64)
    lib.kvscale_apply_token_bitmask(logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16),
                                    index.data_ptr(), len(rows), bitmask.data_ptr(), bitmask.shape[1],
                                    logits.shape[1], torch.get_num_threads())
    return True
