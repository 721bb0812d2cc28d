"""Projections in C (``x W^T``): bfloat16 and int8 weights on AMX tiles, laid out once in the order
the kernel streams them (cpu_linear_amx.c); bfloat16 weights on a few rows with the CPU's bf16 dot
products where it has those but no AMX (cpu_linear_dot.c); and bfloat16 or int8 weights widened as
they are read on a decode step's few float32 rows where the CPU has no bf16 or int8 dot products
(cpu_linear_narrow.c). The engine's linear layers pick between these and oneDNN."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvscale.kernels.cpu_build import library


@functools.cache
def amx_linear_available() -> bool:
    """Whether bfloat16 projections run in C here: a build with AMX and the OS's leave to use it."""
    lib = library()
    return lib is not None and bool(lib.kvscale_linear_amx_available())


AMX_LINEAR_MULTIPLE = 32  # cpu_linear_amx.c's blocks: in and out features are multiples of it


def _packed(weight: Tensor, packer: str) -> Tensor:
    """``weight`` laid out by the library's ``packer`` into a flat bfloat16 tensor of its size (the
    caller checked that the kernel runs it, so the library is there)."""
    out_features, in_features = weight.shape
    plain = weight.detach().contiguous()
    packed = torch.empty(plain.numel(), dtype=torch.bfloat16)
    lib = library()
    assert lib is not None
    getattr(lib, packer)(plain.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def pack_linear_amx(weight: Tensor) -> Tensor | None:
    """``weight`` ``[out, in]`` (bfloat16) laid out for :func:`linear_amx` (a flat tensor), or
    None where that kernel does not run it (no AMX, another dtype, sizes not multiples of 32)."""
    out_features, in_features = weight.shape
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or out_features % AMX_LINEAR_MULTIPLE
            or in_features % AMX_LINEAR_MULTIPLE or not amx_linear_available()):
        return None
    return _packed(weight, "kvscale_linear_amx_pack")


def silu_mul_fits(out_features: int) -> bool:
    """Whether a gate|up projection of ``out_features`` can apply SiLU-and-multiply as it stores:
    each half a whole number of the kernels' 32-column blocks."""
    return out_features % (2 * AMX_LINEAR_MULTIPLE) == 0


def _projected(x: Tensor, kernel: str, packed: Tensor, bias: Tensor | None, out_features: int,
               silu_mul: bool) -> tuple[int, Tensor]:
    """The library's ``kernel`` (linear_amx's or linear_dot's contract) on ``x``'s rows: its status
    and the output it wrote (the caller checked the library is there when it packed the weight)."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = x.new_empty((*x.shape[:-1], out_features // 2 if silu_mul else out_features))
    lib = library()
    assert lib is not None
    status = getattr(lib, kernel)(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                  None if bias is None else bias.data_ptr(), rows.shape[0], out_features,
                                  in_features, out.data_ptr(), int(silu_mul), torch.get_num_threads())
    return status, out


def linear_amx(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, silu_mul: bool = False) -> Tensor:
    """``x W^T (+ bias)`` for ``x`` ``[..., in]`` bfloat16 and ``packed`` from
    :func:`pack_linear_amx`; ``bias`` float32 or None. With ``silu_mul`` (W a fused gate|up, see
    :func:`silu_mul_fits`), ``silu_and_mul`` of that product instead, bit for bit, in one pass."""
    status, out = _projected(x, "kvscale_linear_amx", packed, bias, out_features, silu_mul)
    _check_linear_status(status)
    return out


_LINEAR_UNSUPPORTED = 1  # cpu_linear_amx.c's KVSCALE_LINEAR_UNSUPPORTED


def _check_linear_status(status: int) -> None:
    if status == _LINEAR_UNSUPPORTED:
        raise ValueError("the AMX projection cannot run this call: no AMX tiles granted here, or silu_mul on "
                         "halves that split a 32-column block (silu_mul_fits says which shapes fit)")
    if status:
        raise MemoryError("the AMX projection could not allocate its activation buffer")


AMX_INT8_DEPTH = 64  # cpu_linear_amx.c's int8 blocks: in features are a multiple of it


def pack_linear_amx_int8(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """An int8 ``weight`` ``[out, in]`` laid out for :func:`linear_amx_int8`, and each output
    column's weight sum (int32); None where that kernel does not run it."""
    out_features, in_features = weight.shape
    if (weight.dtype != torch.int8 or weight.device.type != "cpu" or out_features % AMX_LINEAR_MULTIPLE
            or in_features % AMX_INT8_DEPTH or not amx_linear_available()):
        return None
    plain = weight.contiguous()
    packed = torch.empty(plain.numel(), dtype=torch.int8)
    column_sums = torch.empty(out_features, dtype=torch.int32)
    lib = library()
    assert lib is not None  # amx_linear_available() said so
    lib.kvscale_linear_amx_int8_pack(plain.data_ptr(), out_features, in_features, packed.data_ptr(),
                                     column_sums.data_ptr())
    return packed, column_sums


def linear_amx_int8(xq: Tensor, x_scales: Tensor, packed: tuple[Tensor, Tensor], w_scales: Tensor,
                    bias: Tensor | None, out_dtype: torch.dtype, silu_mul: bool = False) -> Tensor:
    """``(xq - 128) Wq^T * w_scales * x_scales[:, None] + bias`` in ``out_dtype`` (bfloat16 or
    float32): ``xq`` ``[rows, in]`` uint8 (int8 values +128) with float32 ``x_scales``, the
    weight from :func:`pack_linear_amx_int8`, float32 ``w_scales`` and ``bias``; ``silu_mul`` as
    in :func:`linear_amx`."""
    weight, column_sums = packed
    # Named: a temporary's memory would be freed once its data_ptr() was read, before the call.
    xq, x_scales = xq.contiguous(), x_scales.contiguous()
    rows, in_features = xq.shape
    out_features = column_sums.shape[0]
    out = torch.empty((rows, out_features // 2 if silu_mul else out_features), dtype=out_dtype)
    lib = library()
    assert lib is not None  # pack_linear_amx_int8() needed it
    status = lib.kvscale_linear_amx_int8(
        xq.data_ptr(), x_scales.data_ptr(), weight.data_ptr(), column_sums.data_ptr(),
        w_scales.data_ptr(), None if bias is None else bias.data_ptr(), rows, out_features, in_features,
        out.data_ptr(), int(out_dtype == torch.bfloat16), int(silu_mul), torch.get_num_threads())
    _check_linear_status(status)
    return out


@functools.cache
def dot_linear_available() -> bool:
    """Whether bfloat16 projections run on the bf16 dot-product kernel here (cpu_linear_dot.c): a
    build with AVX-512 BF16."""
    lib = library()
    return lib is not None and bool(lib.kvscale_linear_dot_available())


DOT_LINEAR_COLUMNS = 64  # cpu_linear_dot.c's column blocks: out features are a multiple of it


def pack_linear_dot(weight: Tensor) -> Tensor | None:
    """``weight`` ``[out, in]`` (bfloat16) laid out for :func:`linear_dot` (a flat tensor), or None
    where that kernel does not run it (no AVX-512 BF16, another dtype, out features not a multiple
    of 64 or in features odd)."""
    out_features, in_features = weight.shape
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or out_features % DOT_LINEAR_COLUMNS
            or in_features % 2 or not dot_linear_available()):
        return None
    return _packed(weight, "kvscale_linear_dot_pack")


def dot_silu_mul_fits(out_features: int) -> bool:
    """Whether a gate|up projection of ``out_features`` can apply SiLU-and-multiply as the dot
    kernel stores it: each half a whole number of its column blocks."""
    return out_features % (2 * DOT_LINEAR_COLUMNS) == 0


def linear_dot(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, silu_mul: bool = False) -> Tensor:
    """:func:`linear_amx`'s contract on the bf16 dot-product kernel, for ``packed`` from
    :func:`pack_linear_dot`; each row's result is the same bits whatever other rows the call has."""
    status, out = _projected(x, "kvscale_linear_dot", packed, bias, out_features, silu_mul)
    if status:
        raise ValueError("the dot-product projection cannot run this call: no AVX-512 BF16 here, or silu_mul on "
                         "halves that split a 64-column block (dot_silu_mul_fits says which shapes fit)")
    return out


@functools.cache
def narrow_linear_available() -> bool:
    """Whether projections with a bf16 or int8 weight can run on a few float32 rows in C here
    (cpu_linear_narrow.c): a build with AVX2 and FMA."""
    lib = library()
    return lib is not None and bool(lib.kvscale_linear_narrow_available())


def linear_narrow(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in float32 for float32 ``x`` ``[rows, in]`` (a unit stride in a row) and a
    contiguous bfloat16 or int8 ``weight`` ``[out, in]``, widened as it is read; only where
    :func:`narrow_linear_available`."""
    assert weight.dtype in (torch.bfloat16, torch.int8) and weight.is_contiguous() and x.stride(1) == 1
    rows, in_features = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    lib = library()
    assert lib is not None  # narrow_linear_available() said so
    status = lib.kvscale_linear_narrow(x.data_ptr(), rows, x.stride(0), weight.data_ptr(),
                                       int(weight.dtype == torch.int8), weight.shape[0], in_features,
                                       out.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError("the narrow projection is not built here (no AVX2 and FMA): check narrow_linear_available()")
    return out
