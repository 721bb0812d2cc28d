"""``--kv-cache-dtype``: what the KV cache stores (vLLM's spelling), resolved against the model's
dtype and the kernel backend that will read it.

``auto`` stores K/V in the model's dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store one byte
per element, half a bfloat16 cache's bytes, so the same memory holds twice the blocks and decode
attention (bound by how fast it reads the cache) reads half as much: the semantics, per-layer
scales included, are in :mod:`kvscale.kernels.fp8`. Only the CPU backend (C kernels and the
PyTorch reference) reads and writes an FP8 cache; the Triton backend is refused here, at start,
rather than failing at the first step.
"""

from __future__ import annotations

import torch

from kvscale import kernels
from kvscale.server.config import KV_CACHE_DTYPES

__all__ = ["kv_cache_dtype_name", "resolve_kv_cache_dtype"]

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP8_NAMES = {dtype: name for name, dtype in _FP8.items()}
_FP8["fp8"] = torch.float8_e4m3fn


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache tensors' dtype for ``--kv-cache-dtype name``, or a ValueError saying why this
    engine cannot have it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported (supported: {', '.join(KV_CACHE_DTYPES)})")
    if name == "auto":
        return model_dtype
    if kernels.use_triton(device):
        raise ValueError(
            f"--kv-cache-dtype {name} needs the CPU kernels; the Triton kernels on {device} read a cache in "
            "the model's dtype only (use --kv-cache-dtype auto)"
        )
    return _FP8[name]


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """How logs and /metrics name a cache dtype: vLLM's spelling for FP8, torch's otherwise."""
    return _FP8_NAMES.get(dtype, str(dtype).removeprefix("torch."))
