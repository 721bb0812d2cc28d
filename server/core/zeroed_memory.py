"""Zeroed CPU tensors whose pages arrive as they are first written: the KV cache and the host
KV tier are sized for the pod's memory, and ``torch.zeros`` would write every page of them at
start-up (about a second per 2 GiB on a 2-core CPU, docs/performance.md "Autoscaling")."""

from __future__ import annotations

import mmap
from math import prod

import torch


def lazily_zeroed(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor on page-aligned anonymous memory, which the kernel zeroes
    page by page on first touch; it counts in the process's RSS as it is used."""
    nbytes = prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # kept alive by the tensor that views it
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(tuple(shape))
