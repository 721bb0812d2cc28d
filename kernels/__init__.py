"""Paged-KV kernels: KV write, decode attention and (chunked) prefill attention.

Each operation has a PyTorch reference (:mod:`kvscale.kernels.reference`) and a Triton kernel
(:mod:`kvscale.kernels.triton_kernels`, the GPU path); decode attention also has a C kernel for
CPUs (:mod:`kvscale.kernels.cpu_native`, built on first use, the reference where it cannot be).
The functions exported here dispatch on the tensors' device: CUDA tensors go to Triton, anything
else to the CPU path.
``KVSCALE_FORCE_TRITON=1`` sends CPU tensors to Triton too, which together with
``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter (how the tests check them).

Triton is imported only when a kernel is first launched, so importing this package needs
neither a GPU nor a working Triton install.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from torch import Tensor

from kvscale.kernels import cpu_native, reference

__all__ = [
    "write_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "triton_kernels",
    "use_triton",
]


def use_triton(tensor: Tensor) -> bool:
    """Whether the kernels for ``tensor`` run in Triton (CUDA, or forced by the environment)."""
    return tensor.is_cuda or os.environ.get("KVSCALE_FORCE_TRITON", "0") not in ("", "0")


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    impl = _triton() if use_triton(k_cache) else reference
    impl.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    impl = _triton() if use_triton(query) else cpu_native
    return impl.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> Tensor:
    if use_triton(query):
        # The launch grid needs the longest query; from the host it costs no device sync.
        return _triton().paged_prefill_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
            max_query_len=max_query_len,
        )
    return reference.paged_prefill_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
        decode=cpu_native.paged_decode_attention,
    )


write_kv.__doc__ = reference.write_kv.__doc__
paged_decode_attention.__doc__ = reference.paged_decode_attention.__doc__
paged_prefill_attention.__doc__ = reference.paged_prefill_attention.__doc__


def _triton() -> ModuleType:
    return importlib.import_module("kvscale.kernels.triton_kernels")


def __getattr__(name: str) -> Any:
    # ``kvscale.kernels.triton_kernels`` as an attribute, without importing triton up front.
    if name == "triton_kernels":
        return _triton()
    raise AttributeError(f"module 'kvscale.kernels' has no attribute {name!r}")
