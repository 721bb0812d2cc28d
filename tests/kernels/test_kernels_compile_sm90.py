"""Compile every Triton kernel for an H100 (sm_90) ahead of time, without a GPU.

The interpreter checks what the kernels compute but not whether they compile: layouts,
``tl.dot`` shape limits and dtype rules are enforced only by the real compiler. Triton ships
ptxas, so the whole pipeline down to a cubin runs on a CPU-only machine.
"""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction

from kvscale.kernels.decode_attention import _decode_kernel, _merge_partitions_kernel
from kvscale.kernels.kv_write import _write_kv_kernel
from kvscale.kernels.layer_ops_triton import (
    _add_rms_norm_kernel,
    _rope_kernel,
    _silu_and_mul_kernel,
)
from kvscale.kernels.lora_triton import _expand_kernel, _shrink_kernel
from kvscale.kernels.prefill_attention import _prefill_kernel

H100 = GPUTarget("cuda", 90, 32)
# The bundled model's attention shapes with the launchers' CUDA tile sizes.
SHAPE = {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_SIZE": 16, "BLOCK_D": 64}


def compile_for_h100(kernel, pointers: dict[str, str], constants: dict) -> object:
    assert not isinstance(kernel, InterpretedFunction), "unset TRITON_INTERPRET for this test"
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "i32")
    constexprs = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=H100, options={"num_warps": 4})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_to_sm90_cubin(dtype: str) -> None:
    dot = {"DOT_DTYPE": tl.bfloat16 if dtype == "bf16" else tl.float32,
           "DOT_PRECISION": "tf32" if dtype == "bf16" else "ieee"}
    tensors = {name: "*" + dtype for name in
               ["query_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr"]}
    tensors |= {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                "query_start_loc_ptr": "*i32", "slot_ptr": "*i64", "scale_log2": "fp32",
                "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    lora = {"x_ptr": "*" + dtype, "h_ptr": "*" + dtype, "out_ptr": "*" + dtype,
            "table_ptr": "*i64", "rows_ptr": "*i64", "tiles_ptr": "*i64"}
    compiled = [
        compile_for_h100(_decode_kernel, tensors, {
            **SHAPE, **dot, "BLOCK_G": 16, "BLOCK_N": 64, "SINGLE_PARTITION": False}),
        compile_for_h100(_merge_partitions_kernel, tensors,
                         {"HEAD_DIM": 64, "BLOCK_P": 32, "BLOCK_D": 64}),
        compile_for_h100(_prefill_kernel, tensors, {
            **SHAPE, **dot, "BLOCK_M": 64, "BLOCK_N": 64}),
        compile_for_h100(_write_kv_kernel, tensors,
                         {"NUM_KV_HEADS": 3, "HEAD_DIM": 64, "BLOCK_H": 4, "BLOCK_D": 64}),
        compile_for_h100(_add_rms_norm_kernel, {
            **{n: "*" + dtype for n in ["x_ptr", "residual_ptr", "weight_ptr", "out_ptr"]}, "eps": "fp32"},
            {"HAS_RESIDUAL": True, "BLOCK": 1024}),
        compile_for_h100(_rope_kernel, {n: "*" + dtype for n in ["x_ptr", "cos_ptr", "sin_ptr", "out_ptr"]},
                         {"HEAD_DIM": 64, "HALF": 32, "BLOCK_H": 16, "BLOCK_HALF": 32}),
        compile_for_h100(_silu_and_mul_kernel, {n: "*" + dtype for n in ["gate_up_ptr", "out_ptr"]},
                         {"BLOCK": 1024}),
        # Rank 16 on q|k|v's three slices: k = 48, in a 64-wide block.
        compile_for_h100(_shrink_kernel, lora, {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_IN": 64, **dot}),
        compile_for_h100(_expand_kernel, lora, {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_N": 64, **dot}),
    ]
    for kernel in compiled:
        assert kernel.asm["cubin"], "no cubin produced"
        assert ".target sm_90" in kernel.asm["ptx"]
        # Shared memory must fit an H100's 227 KiB per block.
        assert kernel.metadata.shared <= 227 * 1024
