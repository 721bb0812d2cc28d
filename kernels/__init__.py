"""Paged-KV kernels: KV write, decode attention and (chunked) prefill attention.

Each op's signature and contract is written once, in :mod:`kvscale.kernels.ops`; three backends
implement every op, each one :class:`~kvscale.kernels.ops.KernelBackend`:

- ``reference.REFERENCE``: PyTorch ops, the semantics the others must match;
- ``cpu_native.CPU``: the engine's CPU path, decode attention in C (built on first use, the
  reference where it cannot be), the rest the reference;
- ``triton_kernels.TRITON``: the GPU path.

:func:`backend_for` picks one for a device: CUDA goes to Triton, anything else to the CPU backend.
``KVSCALE_FORCE_TRITON=1`` sends CPU tensors to Triton too, which together with
``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter (how the tests check them). The
engine picks once, when it builds its runner, and calls the backend's functions directly.

Triton is imported only when the Triton backend is first picked, so importing this package needs
neither a GPU nor a working Triton install.
"""

from __future__ import annotations

import os

import torch

from kvscale.kernels import cpu_native, reference
from kvscale.kernels.ops import KernelBackend

__all__ = ["KernelBackend", "backend_for", "cpu_native", "reference", "use_triton"]


def use_triton(device: torch.device) -> bool:
    """Whether the kernels for tensors on ``device`` run in Triton (CUDA, or forced)."""
    return device.type == "cuda" or os.environ.get("KVSCALE_FORCE_TRITON", "0") not in ("", "0")


def backend_for(device: torch.device) -> KernelBackend:
    """The backend for tensors on ``device`` (and this process's environment)."""
    if use_triton(device):
        from kvscale.kernels.triton_kernels import TRITON

        return TRITON
    return cpu_native.CPU
