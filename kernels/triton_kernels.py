"""The Triton backend: the GPU path, also run on CPU tensors by Triton's interpreter in tests.

Importing this module imports triton; :mod:`kvscale.kernels` does so only on first use.
"""

from kvscale.kernels.decode_attention import paged_decode_attention
from kvscale.kernels.kv_write import write_kv
from kvscale.kernels.ops import KernelBackend
from kvscale.kernels.prefill_attention import paged_prefill_attention

TRITON = KernelBackend(
    "triton",
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    prefill_batches_decodes=False,
)

__all__ = ["TRITON", "write_kv", "paged_decode_attention", "paged_prefill_attention"]
