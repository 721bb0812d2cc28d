"""int8 weights (``--quantization int8``): every projection quantized when the model loads.

Weights per output channel (symmetric, scale = max|w| / 127), activations per token at every
call (the same rule on each row of the input), the products of the codes summed exactly and
rescaled by both scales in float32: on oneDNN's prepacked int8 GEMM where the CPU has VNNI or AMX,
elsewhere in float32 over the codes widened as they are used (``cpu_linear.widened_matmul``),
at about float32's speed: int8 then saves memory, not time. A first
look on the 2-vCPU AMD EPYC (AVX-512 VNNI; one thread; one layer's four projections; taken while
another benchmark ran, so indicative only): 0.37 / 2.1 / 95 ms on 16 / 64 / 512 rows against
oneDNN-packed float32's 0.63 / 5.6 / 182, 0.18 against 0.21 on one row. The weight-only kernel
(``_weight_int8pack_mm``) took 790 ms on 64 rows with float32 activations, 11.8 with bf16.

Per-token int8 cannot hold the few input channels the RMSNorm gains scale far up: the q/k/v
and gate/up projections that read a norm first move that range into their weights (``smooth_into``).

The embedding stays in the model's dtype (a lookup, no GEMM); the LM head tied to it gets its
own int8 copy. CPU only: on CUDA the engine refuses the flag rather than run something else.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvscale.kernels import cpu_native
from kvscale.server.config import QUANTIZATIONS
from kvscale.server.worker.cpu_features import cpu_features
from kvscale.server.worker.cpu_linear import AMX_ROWS_MAX, amx_packs, widened_matmul

logger = logging.getLogger(__name__)

# How much of the activations' range smoothing moves into the weights (SmoothQuant's alpha): on the
# bundled model's fixed text (tests/server/worker/test_precision_accuracy.py) 0.5 gave the lowest
# perplexity ratio, 1.022 against 1.048 unsmoothed and 1.031 / 1.073 at 0.75 / 1.0.
SMOOTHING_ALPHA = 0.5


def check_quantization(name: str | None, device_type: str | None = None, *,
                       mixture_of_experts: bool = False) -> None:
    """Refuse a method this engine does not run (the message names what it does)."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not supported (supported: {', '.join(QUANTIZATIONS)})")
    if device_type is not None and device_type != "cpu":
        raise ValueError(f"quantization {name!r} runs on the CPU only, not on {device_type!r}")
    if mixture_of_experts:
        # Smoothing one norm into a router and every expert at once, and an int8 router that may
        # pick other experts, are untried: no accuracy bound is measured for them.
        raise ValueError(f"quantization {name!r} does not cover mixture-of-experts models yet; "
                         "serve this one without it")


def quantize_per_row(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``q`` and float32 ``scale`` with ``t ≈ q * scale[:, None]``."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(t / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(-1)


def onednn_int8() -> bool:
    """Whether this machine's int8 projections run on oneDNN's prepacked int8 GEMM: torch has the
    ops, and the CPU multiplies u8 by s8 into int32 in one instruction (AVX-512 VNNI, AVX-VNNI or
    AMX). Without VNNI oneDNN's x86 path sums byte pairs into int16 first, which can saturate."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_features().flags)


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_row` stored +128 as uint8 (oneDNN's activations are unsigned with a
    zero point), in one C pass where the kernels run."""
    native = cpu_native.quantize_rows_u8(x)
    if native is not None:
        return native
    q, scale = quantize_per_row(x)
    return (q.to(torch.int16) + 128).to(torch.uint8), scale


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W int8 per output channel and x quantized per row on each call.

    Where :func:`onednn_int8` holds, W is prepacked once for oneDNN's int8 GEMM (AMX or VNNI
    kernels; reordering on every call, as ``torch._int_mm`` does, cost more than the GEMM) and the
    GEMM runs with an input scale of 1, returning ``sum(q_x * q_w) * w_scale``: the per-row input
    scale it cannot take is applied after, so the result is the same integer sums as the
    widened path's. On a Xeon with AMX a forward's projections at 64 rows took 0.4x the time of
    ``_int_mm`` (``python -m bench.cpu_linear``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_per_row(weight.detach())
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale)
        # One copy, in float32: the rescale adds it to float32 sums (C kernel or PyTorch).
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.prepacked = onednn_int8()
        # Decode's few rows on kvscale's AMX kernel, from a second copy of the int8 weight in its
        # layout (server/worker/cpu_linear.py says why; the integer sums are the same exact ones).
        self.amx_weight = cpu_native.pack_linear_amx_int8(q) if self.prepacked and amx_packs() else None
        if self.prepacked:
            self.packed_weight = torch.ops.onednn.qlinear_prepack(q, None)
            self.weight_zero_point = torch.zeros(self.out_features, dtype=torch.int64)
        else:
            # The int8 codes, widened to float32 on each call (cpu_linear.widened_matmul).
            self.weight_q: torch.Tensor
            self.register_buffer("weight_q", q.contiguous())

    def _amx_weight_for(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The AMX kernel's weight where these rows (``[rows, in]``) run on it (decode's few, where
        it is laid out, in an output dtype it writes), else None."""
        if rows.shape[0] <= AMX_ROWS_MAX and rows.dtype in (torch.bfloat16, torch.float32):
            return self.amx_weight
        return None

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul(self(x))`` in one pass, for a gate|up projection, where decode's rows run
        on the AMX kernel (it applies the activation as it stores them); None elsewhere."""
        rows = x.reshape(-1, self.in_features)
        amx_weight = self._amx_weight_for(rows)
        if amx_weight is None or not cpu_native.silu_mul_fits(self.out_features):
            return None
        xq, x_scale = quantize_rows_u8(rows.contiguous())
        out = cpu_native.linear_amx_int8(xq, x_scale, amx_weight, self.weight_scale, self.bias, x.dtype,
                                         silu_mul=True)
        return out.reshape(*x.shape[:-1], self.out_features // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.prepacked:
            xq, x_scale = quantize_rows_u8(rows)
            amx_weight = self._amx_weight_for(rows)
            if amx_weight is not None:
                fused = cpu_native.linear_amx_int8(xq, x_scale, amx_weight, self.weight_scale, self.bias, x.dtype)
                return fused.reshape(*x.shape[:-1], self.out_features)
            # The GEMM writes the model's dtype (a bf16 output is half the bytes to write and read
            # back), then each row takes its input scale in place: in bf16 two roundings instead of one.
            sums = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, self.packed_weight, self.weight_scale, self.weight_zero_point, None, 1.0, 0,
                x.dtype if x.dtype == torch.bfloat16 else torch.float32, "none", [], "")
            out = cpu_native.rescale_rows(sums, x_scale, self.bias)
            if out is None:
                out = self._rescale(sums.float(), x_scale, x.dtype)
            out = out.to(x.dtype)
        else:
            # Without VNNI, torch._int_mm takes a generic loop 9-62x slower than float32's GEMM;
            # float32 multiplies the same codes exactly (a product of two codes is below 2^14)
            # and sums them exactly while a sum stays below 2^24 (any row of up to 1,040 inputs).
            xq8, x_scale = quantize_per_row(rows)
            sums = widened_matmul(xq8.float(), self.weight_q).mul_(self.weight_scale)
            out = self._rescale(sums, x_scale, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _rescale(self, sums: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        sums.mul_(x_scale[:, None])
        if self.bias is not None:
            sums.add_(self.bias)
        return sums.to(dtype)

    def extra_repr(self) -> str:
        layout = "oneDNN prepacked" if self.prepacked else "plain"
        if self.amx_weight is not None:
            layout += f", up to {AMX_ROWS_MAX} rows on AMX"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8=per-channel, {layout}"


def smooth_into(norm_weight: torch.Tensor, linear: nn.Linear, alpha: float = SMOOTHING_ALPHA) -> None:
    """Move part of each input channel's range from the activation to the weight, exactly.

    ``linear`` reads ``rms_norm(x) * norm_weight``: dividing the norm's weight by ``s`` and
    multiplying the weight's input columns by ``s`` computes the same function, and with
    ``s_j = |g_j|^alpha / max_i |W_ij|^(1 - alpha)`` the channels the norm scales up (the
    activation outliers a per-token scale cannot hold) become smaller, their weight columns
    larger. ``|g_j|`` stands in for the activation's range, so no calibration data is needed.
    """
    with torch.no_grad():
        gain = norm_weight.float().abs().clamp(min=1e-5)
        w_range = linear.weight.float().abs().amax(dim=0).clamp(min=1e-5)
        s = (gain**alpha / w_range ** (1 - alpha)).clamp(min=1e-5)
        norm_weight.copy_((norm_weight.float() / s).to(norm_weight.dtype))
        linear.weight.copy_((linear.weight.float() * s).to(linear.weight.dtype))


def quantize_linears(model: nn.Module) -> int:
    """Smooth each projection that reads a norm's output (see :func:`smooth_into`), then replace
    every ``nn.Linear`` of ``model`` by an :class:`Int8Linear`; returns how many."""
    check_quantization("int8", mixture_of_experts=getattr(getattr(model, "spec", None), "moe", None) is not None)
    if not onednn_int8():
        logger.warning(
            "--quantization int8 on a CPU without VNNI or AMX (no int8 dot products): the projections "
            "multiply the int8 codes in float32, at about float32's speed; int8 saves memory here, not time")
    for layer in getattr(model, "layers", ()):
        smooth_into(layer.input_layernorm.weight, layer.self_attn.qkv_proj)
        smooth_into(layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj)
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, linear in linears:
        setattr(parent, name, Int8Linear(linear.weight, linear.bias))
    return len(linears)
