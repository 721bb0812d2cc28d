"""The engine's C kernels for CPUs: the one surface the rest of kvscale calls them through, and
the CPU kernel backend (``CPU``: C decode attention, C prefill attention on AMX and AVX2 CPUs, the
PyTorch references for the rest). Each concept lives in a module of its own:

- ``cpu_build``: building the C sources on first use, the build cache, loading the library
  (``cpu_prototypes`` its ctypes prototypes), ``KVSCALE_CPU_KERNELS``, ``bind_threads``
  (``cpu_threads.c``: pins the OpenMP pool torch and these kernels share, one thread per CPU);
- ``cpu_attention``: paged decode and prefill attention and the KV write
  (``cpu_decode_attention.c``, ``cpu_prefill_attention.c``, ``cpu_prefill_attention_f32.c``,
  ``cpu_write_kv.c``), and ``CPU``;
- ``cpu_projections``: bfloat16 and int8 projections on AMX tiles (``cpu_linear_amx.c``), bfloat16
  ones on a few rows with AVX-512 BF16 dot products (``cpu_linear_dot.c``) and on a decode step's
  few float32 rows (``cpu_linear_narrow.c``);
- ``cpu_row_ops``: the decoder layer's elementwise steps fused into one pass each
  (``cpu_layer_ops.c``), int8 row quantization (``cpu_quantize.c``), a structured output step's
  token bitmask (``cpu_token_mask.c``);
- ``cpu_step``: a batched step's decoder layers in one call (``cpu_step_layers.c``).

Callers name ``cpu_native.X`` and look it up when they call, so a test or profiler that replaces
an entry point here reaches them; the modules above call one another directly.
"""

from __future__ import annotations

from kvscale.kernels.cpu_attention import (
    CPU,
    amx_prefill_available,
    decode_attention_on_amx,
    f32_prefill_available,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from kvscale.kernels.cpu_build import available, bind_threads
from kvscale.kernels.cpu_projections import (
    AMX_INT8_DEPTH,
    AMX_LINEAR_MULTIPLE,
    DOT_LINEAR_COLUMNS,
    amx_linear_available,
    dot_linear_available,
    dot_silu_mul_fits,
    linear_amx,
    linear_amx_int8,
    linear_dot,
    linear_narrow,
    narrow_linear_available,
    pack_linear_amx,
    pack_linear_amx_int8,
    pack_linear_dot,
    silu_mul_fits,
)
from kvscale.kernels.cpu_row_ops import (
    add_rms_norm,
    apply_token_bitmask,
    quantize_rows_u8,
    rescale_rows,
    rope,
    silu_and_mul,
)
from kvscale.kernels.cpu_step import (
    DecoderLayer,
    DecoderShape,
    Projection,
    StepAttention,
    step_layers,
)

__all__ = [
    "AMX_INT8_DEPTH", "AMX_LINEAR_MULTIPLE", "CPU", "DOT_LINEAR_COLUMNS", "DecoderLayer", "DecoderShape", "Projection",
    "StepAttention", "add_rms_norm", "amx_linear_available", "amx_prefill_available", "apply_token_bitmask",
    "available", "bind_threads", "decode_attention_on_amx", "dot_linear_available", "dot_silu_mul_fits",
    "f32_prefill_available", "linear_amx", "linear_amx_int8", "linear_dot", "linear_narrow", "narrow_linear_available",
    "pack_linear_amx", "pack_linear_amx_int8", "pack_linear_dot", "paged_decode_attention", "paged_prefill_attention",
    "quantize_rows_u8", "rescale_rows", "rope", "silu_and_mul", "silu_mul_fits", "step_layers", "write_kv",
]
