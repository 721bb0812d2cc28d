"""Projections on the CPU: each weight laid out once, at load, for the GEMM that will run it.

- bfloat16 on CPUs with AMX, up to ``AMX_ROWS_MAX`` rows (batched decode): kvscale's own kernel
  (``kernels/cpu_linear_amx.c``), the weight laid out in the order it streams it; more rows
  (prefill) stay on oneDNN's packed GEMM, which is faster there, so such a projection holds its
  weight twice (docs/engine.md, "Measured and not kept", measures both). Layers whose sizes are
  not multiples of 32 keep oneDNN alone.
- bfloat16 on CPUs with AVX-512 BF16 but no AMX (AMD Zen 4 and 5), up to ``DOT_ROWS_MAX`` rows (a
  single stream's decode step, a speculative verify step, a small batch): kvscale's own kernel
  (``kernels/cpu_linear_dot.c``), its weight laid out for the bf16 dot products; more rows stay on
  oneDNN's packed GEMM, so such a projection, as on AMX, holds its weight twice. With it such a
  step's layers run in one C call too (cpu_step_layers.py): on the 2-vCPU EPYC (Zen 5) a single
  stream's bf16 decode went from 0.94x vLLM's CPU build to 1.81x (``python -m bench.spec_decode``,
  kvscale and vLLM without speculation, each ratio from one run).
- bfloat16 where oneDNN has bf16 kernels (AVX-512 BF16, AMX): oneDNN's packed layout, made once.
  ``F.linear`` in bf16 also reaches oneDNN but hands it a plain matrix, which it re-lays out on
  every call. Packed once, a forward's projections on 4-64 rows (batched decode) take 0.58-0.62x
  the time, on 256-2048 rows (prefill) 0.81-1.06x, on one row 1.05-1.16x
  (``python -m bench.cpu_linear``): batched decode is what a server runs.
- float32 on Intel: a transposed view of an ``[in, out]`` buffer for torch's GEMM (MKL). On a
  Xeon oneDNN's packed float32 was 1.4-1.7x slower on one row (a single stream decoding) and no
  faster on prefill.
- float32 on AMD (and Hygon): oneDNN's packed layout too. MKL does not run its AVX-512 code on
  a CPU that is not Intel's (``MKL_DEBUG_CPU_TYPE`` and ``MKL_ENABLE_INSTRUCTIONS`` change
  nothing in MKL 2024), while oneDNN's JIT reads the CPU's features whoever made it: on an AMD
  EPYC with AVX-512 a forward's projections on 16-1024 rows take 0.35-0.4x MKL's time, on one
  row 1.15x (``python -m bench.cpu_linear``; vLLM's CPU build packs float32 through oneDNN too).

- bfloat16 where oneDNN has no bf16 kernels (an AVX2 CPU: they need AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT): the weight stays in bfloat16 and is widened to float32 as it is used
  (``widened_matmul``): up to ``NARROW_ROWS_MAX`` rows in C as each element is loaded, on more a
  block of output channels at a time into memory for torch's float32 GEMM. torch's own bf16 GEMM
  there took 1.2-8x float32's time on a forward's projections; widened, 0.92-1.44x on 1-2048 rows
  (AVX2 EPYC, ``python -m bench.cpu_linear``; docs/performance.md, "Engine throughput on CPU"). A bf16 x
  bf16 product is exact in float32 and the sums are float32's, as in oneDNN's bf16 kernels, so
  the result is a bf16 GEMM's, rounded once.

Packing replaces each ``nn.Linear`` with a ``PackedLinear`` that no longer holds the plain
matrix (the weights' memory is not doubled), except a projection tied to an embedding, whose
matrix the embedding still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvscale.kernels import cpu_native
from kvscale.server.worker.cpu_features import CpuFeatures, cpu_features
from kvscale.server.worker.moe import stack_cpu_experts

# x86 CPUs on which MKL takes its generic path (Arm builds of torch use no MKL: left as they are).
_X86_NOT_INTEL = frozenset({"AuthenticAMD", "HygonGenuine"})

# oneDNN packs for an expected row count; the packed weight then runs any count. Decode-sized.
_PACKING_ROWS_HINT = 64
# The most rows a projection runs on kvscale's AMX kernel rather than oneDNN's (see the docstring).
AMX_ROWS_MAX = 64
# The most rows a projection runs on kvscale's bf16 dot-product kernel rather than oneDNN's.
DOT_ROWS_MAX = 16
# The float32 copy of a weight block a widened GEMM makes at a time: big enough that the GEMM on a
# block runs at full speed, small enough to stay in the last-level cache (on an AVX2 EPYC, 128
# output channels per block took 1.2-2.5x the time of 2048 on 576 inputs).
_WIDENED_BLOCK_BYTES = 4 << 20
# The most rows a widened projection runs in C (see widened_matmul).
NARROW_ROWS_MAX = 64


def packs_with_onednn(dtype: torch.dtype, cpu: CpuFeatures, onednn: bool, onednn_bf16: bool) -> bool:
    """Whether projections in ``dtype`` run packed through oneDNN (``onednn``: torch has it;
    ``onednn_bf16``: it has bf16 kernels for this CPU). The module docstring says why."""
    if not onednn:
        return False
    if dtype == torch.bfloat16:
        return onednn_bf16
    return dtype == torch.float32 and cpu.vendor in _X86_NOT_INTEL


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this machine's projections in ``dtype`` run packed through oneDNN."""
    onednn = torch.backends.mkldnn.is_available()
    return packs_with_onednn(dtype, cpu_features(), onednn, onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def amx_packs() -> bool:
    """Whether bfloat16 projections run on kvscale's AMX kernel."""
    return cpu_native.amx_linear_available()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W in oneDNN's packed layout (an opaque tensor, not a parameter)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_ROWS_HINT)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def widened_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 for float32 ``x`` [rows, in] and a narrower ``weight`` [out, in]
    (bfloat16, or int8 codes). Up to ``NARROW_ROWS_MAX`` rows, in C, each weight element widened
    in registers as it is read (``kernels/cpu_linear_narrow.c``); more rows, a block of output
    channels widened at a time into memory for float32's GEMM, so the memory held stays the
    narrow weight's plus one block."""
    if x.shape[0] <= NARROW_ROWS_MAX and cpu_native.narrow_linear_available():
        return cpu_native.linear_narrow(x if x.stride(1) == 1 else x.contiguous(), weight)
    out_features, in_features = weight.shape
    block = min(out_features, max(64, _WIDENED_BLOCK_BYTES // (4 * in_features)))
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    wide = torch.empty(block, in_features, dtype=torch.float32)
    for start in range(0, out_features, block):
        stop = min(out_features, start + block)
        part = wide[: stop - start]
        part.copy_(weight[start:stop])
        if stop - start == out_features:
            torch.mm(x, part.t(), out=out)
        else:
            out[:, start:stop] = x @ part.t()
    return out


class WidenedLinear(nn.Module):
    """``y = x W^T + b`` for a bfloat16 W where oneDNN has no bf16 kernels: see the module
    docstring. W is the model's own tensor (a tied embedding's included: nothing is copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A contiguous weight is taken as it is: no copy.
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        # In float32: the bias joins the float32 sums before their one rounding.
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = widened_matmul(rows, self.weight)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, widened to float32"


@dataclass(frozen=True)
class RowKernel:
    """One of kvscale's C kernels for a projection's few rows, run from its own copy of W."""

    label: str  # what extra_repr says runs the rows
    rows_max: int  # more rows go to oneDNN's packed GEMM
    # (x, weight in the kernel's layout, float32 bias or None, out_features, silu_mul=...) -> y
    run: Callable[..., torch.Tensor]
    silu_mul_fits: Callable[[int], bool]  # whether a gate|up of these outputs fuses the activation


AMX = RowKernel("AMX", AMX_ROWS_MAX, cpu_native.linear_amx, cpu_native.silu_mul_fits)
DOT = RowKernel("bf16 dot products", DOT_ROWS_MAX, cpu_native.linear_dot, cpu_native.dot_silu_mul_fits)


class RowKernelLinear(PackedLinear):
    """A :class:`PackedLinear` that runs up to ``kernel.rows_max`` rows on one of kvscale's kernels
    (``AMX``: ``kernels/cpu_linear_amx.c``; ``DOT``: ``kernels/cpu_linear_dot.c``), from a second
    copy of W in that kernel's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: RowKernel,
                 kernel_weight: torch.Tensor) -> None:
        super().__init__(weight, bias)
        self.kernel = kernel
        self.kernel_weight = kernel_weight
        # The kernels add the bias in float32, before their one rounding.
        self.kernel_bias = None if bias is None else bias.detach().float()

    def _on_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows run on the kernel (decode's few) rather than oneDNN."""
        return x.numel() <= self.kernel.rows_max * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._on_kernel(x):
            return super().forward(x)
        return self.kernel.run(x, self.kernel_weight, self.kernel_bias, self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul(self(x))`` in one pass, for a gate|up projection on the kernel's rows: the
        kernel applies the activation as it stores them, bit for bit the two ops' result; None
        where the rows go to oneDNN."""
        if not self._on_kernel(x) or not self.kernel.silu_mul_fits(self.out_features):
            return None
        return self.kernel.run(x, self.kernel_weight, self.kernel_bias, self.out_features, silu_mul=True)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", up to {self.kernel.rows_max} rows on {self.kernel.label}"


def lay_out_cpu_linears(model: nn.Module) -> None:
    """Give every ``nn.Linear`` of a CPU model its weight layout (see the module docstring), but
    the experts a mixture-of-experts block runs from its stacked matrices (server/worker/moe.py)."""
    plain = stack_cpu_experts(model)
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and id(child) not in plain]
    seen: set[int] = set()
    for parent, name, linear in linears:
        onednn = onednn_packs(linear.weight.dtype)
        amx_weight = cpu_native.pack_linear_amx(linear.weight) if onednn and amx_packs() else None
        # Without AMX (not merely a shape it does not take): cpu_step_layers.c picks the kernel so.
        dot_weight = (cpu_native.pack_linear_dot(linear.weight) if onednn and not amx_packs() else None)
        if amx_weight is not None:
            setattr(parent, name, RowKernelLinear(linear.weight, linear.bias, AMX, amx_weight))
        elif dot_weight is not None:
            setattr(parent, name, RowKernelLinear(linear.weight, linear.bias, DOT, dot_weight))
        elif onednn:
            setattr(parent, name, PackedLinear(linear.weight, linear.bias))
        elif linear.weight.dtype == torch.bfloat16:
            setattr(parent, name, WidenedLinear(linear.weight, linear.bias))
        elif id(linear.weight) not in seen:
            seen.add(id(linear.weight))
            # Torch's float32 GEMM runs decode's few rows faster against a contiguous [in, out].
            linear.weight.data = linear.weight.data.t().contiguous().t()
