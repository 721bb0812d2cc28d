"""Triton kernels for a decoder layer's element-wise ops on the GPU: residual add + RMSNorm,
rotary embedding of q and k together, and SiLU-and-multiply.

Each replaces a chain of PyTorch ops (the forms in :mod:`kvscale.kernels.layer_ops`) with one
launch. On a GPU a small model's decode step is launch-bound, not bandwidth-bound: the bundled
model's 30 layers ran ~30 element-wise kernels each between their four GEMMs and the attention.
Each kernel rounds to the tensor's dtype wherever the PyTorch form does (a product stored as
bfloat16 before the next op reads it), so both give the same values up to the reductions' order.

Importing this module imports triton; :mod:`kvscale.kernels.layer_ops` does so only on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Keep a * b - c * d as two roundings and a subtraction, as PyTorch's separate ops compute it;
# a fused multiply-add would change float32 results in the last bit.
_EXACT = {"enable_fp_fusion": False}


# The kernels' arguments stay unannotated (type: ignore below): Triton reads annotations as
# specialisation hints, and pointers have no Python type.
@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_row_stride,  # type: ignore[no-untyped-def]
                         residual_row_stride, width, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * residual_row_stride + cols
        summed = (x.to(tl.float32) + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_row, summed, mask=mask)
        x = summed
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / width
    # transformers' order: normalise in float32, round to the model's dtype, then scale.
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride,  # type: ignore[no-untyped-def]
                 cos_token_stride, heads,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    head = tl.arange(0, BLOCK_H)[:, None]
    col = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (head < heads) & (col < HALF)
    first = x_ptr + token * x_token_stride + head * HEAD_DIM + col
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    trig = token * cos_token_stride + col
    cos1 = tl.load(cos_ptr + trig, mask=col < HALF, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + trig, mask=col < HALF, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + trig + HALF, mask=col < HALF, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + trig + HALF, mask=col < HALF, other=0.0).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1f * cos1).to(dtype).to(tl.float32) - (x2f * sin1).to(dtype).to(tl.float32)
    out2 = (x2f * cos2).to(dtype).to(tl.float32) + (x1f * sin2).to(dtype).to(tl.float32)
    out = out_ptr + token * heads * HEAD_DIM + head * HEAD_DIM + col
    tl.store(out, out1.to(dtype), mask=mask)
    tl.store(out + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    gate_f = gate.to(tl.float32)
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up).to(gate.dtype), mask=mask)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor | None:
    """:func:`kvscale.kernels.layer_ops.add_rms_norm` in one launch; None where rows are not
    contiguous (the caller then runs the PyTorch form)."""
    width = x.shape[-1]
    if x.stride(-1) != 1 or weight.dtype != x.dtype or (residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous())):
        return None
    rows = x.numel() // width
    x2d = x.reshape(rows, width)
    residual2d = None if residual is None else residual.view(rows, width)  # a view: written in place
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x2d, x2d if residual2d is None else residual2d, weight, out, x2d.stride(0),
            0 if residual2d is None else residual2d.stride(0), width, eps,
            HAS_RESIDUAL=residual2d is not None, BLOCK=triton.next_power_of_2(width), num_warps=4,
        )
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """:func:`kvscale.kernels.layer_ops.rope` in one launch per step; None where the layout does
    not fit (heads contiguous within a token, cos/sin one ``head_dim`` row per token)."""
    tokens, heads, head_dim = x.shape
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if (x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2 or cos.shape[1] != head_dim
            or cos.stride(1) != 1 or sin.stride() != cos.stride() or cos.dtype != x.dtype):
        return None
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        half = head_dim // 2
        _rope_kernel[(tokens,)](
            x, cos, sin, out, x.stride(0), cos.stride(0), heads, HEAD_DIM=head_dim, HALF=half,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
            **_EXACT,
        )
    return out


def silu_and_mul(gate_up: Tensor) -> Tensor | None:
    """:func:`kvscale.kernels.layer_ops.silu_and_mul` in one launch; None for a strided input."""
    if not gate_up.is_contiguous():
        return None
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * width)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, num_warps=4)
    return out


__all__ = ["add_rms_norm", "rope", "silu_and_mul"]
