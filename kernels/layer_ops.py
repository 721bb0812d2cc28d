"""A decoder layer's element-wise ops, each on the fastest path its tensors allow.

The C kernels (CPU tensors, float32/bfloat16), else the Triton kernels (CUDA tensors, or CPU ones
under ``KVSCALE_FORCE_TRITON=1`` in the interpreter), else the PyTorch form written here, which
defines what the others compute. The model calls these and never picks a path itself.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn

from kvscale.kernels import cpu_native

# Set False to run the PyTorch forms on a GPU: a benchmark's same-run baseline for the kernels.
TRITON_LAYER_OPS = True


def _triton(device: torch.device) -> ModuleType | None:
    """The Triton kernels' module, or None where Triton does not run tensors on ``device``."""
    from kvscale.kernels import use_triton

    if not TRITON_LAYER_OPS or not use_triton(device):
        return None
    from kvscale.kernels import layer_ops_triton

    return layer_ops_triton


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x``; given ``residual``, first ``residual += x`` in place (the sum that closes
    a sublayer) and the norm of that sum (which opens the next)."""
    out = cpu_native.add_rms_norm(x, residual, weight, eps)
    if out is None and (triton := _triton(x.device)) is not None:
        out = triton.add_rms_norm(x, residual, weight, eps)
    if out is not None:
        return out
    if residual is not None:
        x = residual.add_(x)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: float32 statistics, rounded to the input's dtype, then scaled."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: bit-identical to the three-step form below, one pass.
        return nn.functional.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` (heads contiguous within a token,
    tokens any stride apart: the q|k part of the fused qkv output) with each token's cos/sin row
    (``[tokens, 1, head_dim]``, whose halves repeat); a new contiguous tensor."""
    out = cpu_native.rope(x, cos, sin)
    if out is None and (triton := _triton(x.device)) is not None:
        out = triton.rope(x, cos, sin)
    return out if out is not None else torch_rope(x, cos, sin)


def torch_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` into a new tensor, half a head at a time.

    cos/sin repeat their first half in their second (transformers builds them as
    ``cat(freqs, freqs)``), so each half needs two products and one add or subtract: the same
    roundings as the rotate-half form (``a + (-b)`` is ``a - b``), bit for bit, with a third of
    its memory traffic. A partial rotary tail (cos 1, sin 0) also comes out unchanged.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos1, sin1, cos2, sin2 = cos[..., :half], sin[..., :half], cos[..., half:], sin[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos1, out=out[..., :half]).sub_(x2 * sin1)
    torch.mul(x2, cos2, out=out[..., half:]).add_(x1 * sin2)
    return out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate_up[..., :n]) * gate_up[..., n:]``: the MLP's activation of its fused gate|up."""
    out = cpu_native.silu_and_mul(gate_up)
    if out is None and (triton := _triton(gate_up.device)) is not None:
        out = triton.silu_and_mul(gate_up)
    return out if out is not None else torch_silu_and_mul(gate_up)


def projected_silu_and_mul(gate_up_proj: nn.Module, x: Tensor) -> Tensor:
    """``silu_and_mul(gate_up_proj(x))``: in one pass where the projection applies the activation
    as it stores its output (its ``silu_and_mul`` method, the CPU's AMX kernel on decode's rows),
    else the projection and then the op."""
    # Looked up on the class: a miss on the instance goes through nn.Module.__getattr__, which
    # builds and catches an AttributeError every layer of every step.
    fused = getattr(type(gate_up_proj), "silu_and_mul", None)
    out = fused(gate_up_proj, x) if fused is not None else None
    return out if out is not None else silu_and_mul(gate_up_proj(x))


def torch_silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


__all__ = ["add_rms_norm", "projected_silu_and_mul", "rope", "silu_and_mul", "torch_rms_norm", "torch_rope", "torch_silu_and_mul", "TRITON_LAYER_OPS"]
