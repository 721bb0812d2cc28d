"""The FP8 KV cache formats (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) and what a cached
value means in them: the semantics every backend's write and read of such a cache must match.

A cache of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` holds ``x / scale`` rounded to the
nearest even FP8 value and saturated at the format's largest finite value (448, 57344), with one
float32 scale per layer for K and one for V (vLLM's per-tensor ``k_scale``/``v_scale``, 1.0
unless a checkpoint says otherwise); a read gives ``float(q) * scale``. Scales apply to FP8
caches only: a float32/bfloat16/float16 cache holds the values themselves. NaN stays NaN on the
way in (the C kernels read an e4m3 NaN back as 480: nothing writes one but a NaN activation).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FP8_DTYPES", "cache_format", "dequantize", "is_fp8", "quantize", "refuse_fp8"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# The C kernels' `cache_format` argument (cpu_decode_attention.c, cpu_prefill_attention.c).
_C_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def cache_format(dtype: torch.dtype) -> int | None:
    """The C kernels' code for a cache of ``dtype``; None for one they do not read."""
    return _C_FORMATS.get(dtype)


def quantize(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``x / scale`` as ``dtype``: rounded to nearest even, saturated (torch's own cast would turn
    e5m2 overflow into infinity)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(q: Tensor, scale: float) -> Tensor:
    """What an FP8 cache holds, in float32."""
    return q.to(torch.float32) * scale


def refuse_fp8(cache: Tensor, backend: str) -> None:
    """For a backend without FP8 kernels: an error instead of reading bytes as something else."""
    if is_fp8(cache.dtype):
        raise NotImplementedError(f"the {backend} kernels do not read or write an FP8 KV cache ({cache.dtype})")
