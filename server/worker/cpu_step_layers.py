"""A batched step's decoder layers in one C call, on CPUs whose projections run on AMX or, on
fewer rows, on AVX-512 BF16 dot products.

Each layer is about ten kernels; called one by one from Python, each paid a few microseconds of
module dispatch, argument checks, tensor allocation and ctypes besides its work: over the bundled
model's 30 layers, a fifth of a 64-sequence decode step on two cores. ``kernels/cpu_step_layers.c``
runs the same kernels in the same order, so a step's output is bit for bit the modules' (tests/server/
worker/test_cpu_step_layers.py). This module decides where it applies and hands it the weights
as the modules hold them: decode steps, and steps with prompt chunks where the AMX prefill
attention runs them, up to the rows the AMX projections take. The rest (longer steps, float32,
oneDNN projections, per-head q/k norms, partial rotary, mixture-of-experts layers) stays on the
modules. Without AMX, the projections' few rows run on the bf16 dot-product kernel
(server/worker/cpu_linear.py's RowKernelLinear on DOT), and so do the steps here: up to ``DOT_ROWS_MAX`` rows, a
single stream's decode and speculative verify steps among them.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from kvscale.kernels import cpu_native, fp8
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.cpu_linear import AMX, DOT, DOT_ROWS_MAX, RowKernelLinear
from kvscale.server.worker.quantization import Int8Linear

if TYPE_CHECKING:
    from kvscale.server.worker.model_llama import MLP, Attention, DecoderForCausalLM, DecoderLayer

logger = logging.getLogger(__name__)

# Cache dtypes the C attention and KV write take with a bfloat16 query.
_CACHE_DTYPES = (torch.bfloat16, *fp8.FP8_DTYPES)

# The most rows a step runs here, its projections all on the AMX kernel. Past the modules' 64
# (server/worker/cpu_linear.py's AMX_ROWS_MAX) the kernel is slower than oneDNN's GEMM by about 1.4 ms
# a forward at 128 rows and 4.8 ms at 256 (bf16, `python -m bench.cpu_linear_stream --threads
# 2`), less than the ~7 ms of calls from Python a step saves here; at 512 rows the
# two are even, and such steps (prompts) stay on the modules and oneDNN.
STEP_ROWS_MAX = 256

# Calls a step's layers are split into where a check runs between them (priority scheduling's
# step given up, server/core/step_interrupt.py): a check every ~4 of the bundled model's 30
# layers, for ~8 calls' overhead where one did.
CHECKED_RUNS = 8


def _decoder_layers(model: DecoderForCausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


def _projection(module: nn.Module, silu_mul: bool = False) -> cpu_native.Projection | None:
    """``module``'s weight as the kernel cpu_step_layers.c runs it with holds it (AMX where
    permitted, else the bf16 dot products), or None where it does not run on that kernel."""
    out_features = getattr(module, "out_features", 1)
    kernel = AMX if cpu_native.amx_linear_available() else DOT
    if silu_mul and not kernel.silu_mul_fits(out_features):
        return None
    if isinstance(module, RowKernelLinear) and module.kernel is kernel:
        bias = module.kernel_bias
        return cpu_native.Projection(module.kernel_weight.data_ptr(), None, None, None if bias is None else bias.data_ptr(),
                                     module.out_features, module.in_features)
    if kernel is not AMX:
        return None
    if isinstance(module, Int8Linear) and module.prepacked and module.amx_weight is not None:
        packed, column_sums = module.amx_weight
        bias = module.bias
        return cpu_native.Projection(packed.data_ptr(), column_sums.data_ptr(), module.weight_scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), module.out_features, module.in_features)
    return None


class CpuStepLayers:
    """The decoder layers of one model as ``kvscale_step_layers`` takes them."""

    def __init__(self, attentions: list[Attention], layers: ctypes.Array, shape: cpu_native.DecoderShape,
                 rows_max: int = STEP_ROWS_MAX) -> None:
        # The model owns this object and every buffer the structs point into; the attention
        # modules are kept for their KV scales, which may change after load.
        self.attentions = attentions
        self.layers = layers
        self.shape = shape
        self.rows_max = rows_max
        self._checked_runs: list[ctypes.Array] | None = None

    @classmethod
    def for_model(cls, model: DecoderForCausalLM) -> CpuStepLayers | None:
        """The one-call path for ``model``, or None where some layer needs the modules."""
        spec = model.spec
        weight = model.embed_tokens.weight
        if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
                or not cpu_native.available() or spec.qk_norm or spec.head_dim % 16 or spec.head_dim > 128):
            return None
        if spec.moe is not None:
            logger.info("kvscale engine: a step's layers run one module at a time: the one-call C path "
                        "(kernels/cpu_step_layers.c) has no mixture-of-experts block")
            return None
        structs, attentions = [], []
        for layer in _decoder_layers(model):
            attn, mlp = layer.self_attn, cast("MLP", layer.mlp)  # dense: a model with experts returned above
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not attn.rope_halves_repeat or any(n.dtype != torch.bfloat16 or not n.is_contiguous() for n in norms):
                return None
            projections = (_projection(attn.qkv_proj), _projection(attn.o_proj),
                           _projection(mlp.gate_up_proj, silu_mul=True), _projection(mlp.down_proj))
            if any(p is None for p in projections):
                return None
            structs.append(cpu_native.DecoderLayer(norms[0].data_ptr(), norms[1].data_ptr(), *projections))
            attentions.append(attn)
        shape = cpu_native.DecoderShape(
            hidden=spec.hidden_size, intermediate=spec.intermediate_size, num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, eps=spec.rms_norm_eps, scale=spec.head_dim**-0.5)
        rows_max = STEP_ROWS_MAX if cpu_native.amx_linear_available() else DOT_ROWS_MAX
        return cls(attentions, (cpu_native.DecoderLayer * len(structs))(*structs), shape, rows_max)

    def applies(self, rows: int, kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata) -> bool:
        """Whether this step's batch runs here: up to ``rows_max`` rows, on the CPU kernels,
        over caches their attention reads, and for prompt chunks, where the AMX prefill kernel
        runs them."""
        if meta.kernels.name != "cpu" or not 0 < rows <= self.rows_max or meta.split is not None:
            return False
        dtype, shape = kv_caches[0][0].dtype, kv_caches[0][0].shape
        if dtype not in _CACHE_DTYPES or not all(
                c.dtype == dtype and c.shape == shape and c.is_contiguous() for pair in kv_caches for c in pair):
            return False
        num_seqs = meta.context_lens.numel()
        if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs or meta.slot_mapping.numel() != rows:
            return False  # the modules' path raises its own error for these
        if meta.is_decode:
            return num_seqs == rows
        return (meta.query_start_loc.numel() == num_seqs + 1 and self.shape.head_dim % 32 == 0
                and cpu_native.amx_prefill_available())

    def run(self, hidden: Tensor, positions: Tensor, cos_table: Tensor, sin_table: Tensor,
            kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata,
            check: Callable[[], None] | None = None) -> tuple[Tensor, Tensor]:
        """The last layer's MLP output and the residual stream (the final norm is the model's),
        from the token embeddings ``hidden``, which it overwrites. With ``check``, the layers run
        in ``CHECKED_RUNS`` calls and ``check`` is called before each (it may raise to give the
        step up)."""
        for struct, attention, (k_cache, v_cache) in zip(self.layers, self.attentions, kv_caches, strict=True):
            struct.k_cache, struct.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            struct.k_scale, struct.v_scale = attention.k_scale, attention.v_scale
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        cache_format = fp8.cache_format(kv_caches[0][0].dtype)
        assert cache_format is not None  # applies() said so
        self.shape.cache_format, self.shape.block_size, self.shape.num_blocks = cache_format, block_size, num_blocks
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.context_lens.to(torch.int32).contiguous()
        step_attention = cpu_native.StepAttention(tables.data_ptr(), tables.shape[1], lens.data_ptr(), None, lens.numel())
        if not meta.is_decode:
            # Every tensor the struct points into stays named until the call returns.
            starts = meta.query_start_loc.to(torch.int32).contiguous()
            if int(starts[0]) != 0 or int(starts[-1]) != hidden.shape[0]:
                raise ValueError(f"query_start_loc {starts.tolist()} does not describe {hidden.shape[0]} tokens")
            single = ((starts[1:] - starts[:-1]) == 1).nonzero().flatten()
            single_rows = starts[:-1].index_select(0, single).to(torch.int64)
            single_tables = tables.index_select(0, single).contiguous()
            single_lens = lens.index_select(0, single).contiguous()
            step_attention.query_start_loc = starts.data_ptr()
            step_attention.single_rows, step_attention.single_tables = single_rows.data_ptr(), single_tables.data_ptr()
            step_attention.single_lens, step_attention.num_single = single_lens.data_ptr(), single.numel()
        cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
        if check is None:
            cpu_native.step_layers(self.layers, self.shape, hidden, residual, positions, cos_table, sin_table,
                                   slots, step_attention)
            return hidden, residual
        for k, run in enumerate(self._runs()):
            check()
            cpu_native.step_layers(run, self.shape, hidden, residual, positions, cos_table, sin_table, slots,
                                   step_attention, residual_ready=k > 0)
        return hidden, residual

    def _runs(self) -> list[ctypes.Array]:
        """The layers in ``CHECKED_RUNS`` consecutive runs (views of the one array of structs,
        so what ``run`` writes into it is theirs too)."""
        if self._checked_runs is None:
            num_layers, size = len(self.layers), ctypes.sizeof(cpu_native.DecoderLayer)
            per_run = -(-num_layers // CHECKED_RUNS)
            self._checked_runs = [
                (cpu_native.DecoderLayer * min(per_run, num_layers - start)).from_buffer(self.layers, start * size)
                for start in range(0, num_layers, per_run)]
        return self._checked_runs
