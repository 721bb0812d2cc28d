"""The Triton kernels behind :mod:`kvscale.kernels`, with the references' signatures.

Importing this module imports triton; :mod:`kvscale.kernels` does so only on first use.
"""

from kvscale.kernels.decode_attention import paged_decode_attention
from kvscale.kernels.kv_write import write_kv
from kvscale.kernels.prefill_attention import paged_prefill_attention

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention"]
