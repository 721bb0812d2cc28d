"""Random paged-KV cases and the comparisons that prove the kernels right.

Shared by the tests (CPU: reference vs dense attention, Triton interpreter vs reference) and by
``bench/gpu_kernels.py --check`` (compiled Triton vs reference on a GPU), so both check the
same things. ``python tests/kernels/kernel_checks.py`` runs the Triton-vs-reference comparisons on
the device it is given and prints one JSON line per case; it exits non-zero if any case fails.

A case scatters dense per-sequence K/V into a shuffled paged cache whose other slots hold
garbage, so a kernel that reads a wrong slot or ignores a length cannot pass.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lora_checks import check_lora
from moe_checks import check_moe
from torch import Tensor

from kvscale.kernels import reference


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has the instructions the C kernels' AMX paths need (bf16 tiles and
    AVX-512 BF16), as /proc/cpuinfo says: what their availability checks must agree with."""
    from kvscale.server.worker.cpu_features import cpu_features

    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_features().flags


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has what the float32 prefill and narrow projection kernels need (AVX2 and
    FMA), as /proc/cpuinfo says."""
    from kvscale.server.worker.cpu_features import cpu_features

    return {"avx2", "fma"} <= cpu_features().flags


# Max abs error allowed against the float64 dense attention / the reference, by dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class PagedCase:
    query: Tensor  # [num_tokens, num_heads, head_dim], new tokens of all seqs concatenated
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor  # int32, padded with -1
    query_start_loc: Tensor  # int32 [num_seqs + 1]
    context_lens: Tensor  # int32 [num_seqs]
    scale: float
    dense_k: list[Tensor]  # per seq [context_len, num_kv_heads, head_dim]
    dense_v: list[Tensor]
    q_lens: list[int]

    def describe(self) -> dict:
        return {
            "dtype": str(self.query.dtype).removeprefix("torch."),
            "num_heads": self.query.shape[1],
            "num_kv_heads": self.k_cache.shape[2],
            "head_dim": self.query.shape[2],
            "block_size": self.k_cache.shape[1],
            "context_lens": self.context_lens.tolist(),
            "q_lens": self.q_lens,
        }


def make_case(
    gen: torch.Generator,
    *,
    context_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
) -> PagedCase:
    """Build a paged cache holding each sequence's context in randomly placed blocks."""
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1  # one more column so every row has padding
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Garbage everywhere first: unwritten slots must never leak into a result.
    k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for seq, ctx in enumerate(context_lens):
        ids = [order.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):
            k_cache[ids[pos // block_size], pos % block_size] = k[pos]
            v_cache[ids[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k)
        dense_v.append(v)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return PagedCase(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        dense_k=dense_k,
        dense_v=dense_v,
        q_lens=list(q_lens),
    )


def random_case(
    gen: torch.Generator,
    *,
    decode: bool,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_context: int = 80,
) -> PagedCase:
    """A small random case: block size 8/16/32, GQA ratio 1/3/4, ragged lengths."""

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size = pick([8, 16, 32])
    num_kv_heads = pick([1, 2, 3])
    ratio = pick([1, 3, 4])
    head_dim = pick([16, 32, 64])
    num_seqs = int(torch.randint(1, 5, (1,), generator=gen))
    contexts = torch.randint(1, max_context + 1, (num_seqs,), generator=gen).tolist()
    if decode:
        q_lens = [1] * num_seqs
    else:
        # Mix whole prompts, chunks after a cached prefix, and single decode tokens.
        q_lens = []
        for ctx in contexts:
            kind = int(torch.randint(3, (1,), generator=gen))
            q_lens.append(ctx if kind == 0 else 1 if kind == 1 else
                          int(torch.randint(1, ctx + 1, (1,), generator=gen)))
    return make_case(
        gen,
        context_lens=contexts,
        q_lens=q_lens,
        num_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )


def dense_attention(case: PagedCase) -> Tensor:
    """Ground truth in float64 over contiguous K/V, one sequence at a time."""
    num_heads = case.query.shape[1]
    outs = []
    start = 0
    for k, v, q_len in zip(case.dense_k, case.dense_v, case.q_lens, strict=True):
        ctx = k.shape[0]
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = case.query[start : start + q_len].cpu().double().transpose(0, 1)  # [H, q_len, D]
        q_pos = torch.arange(ctx - q_len, ctx)
        visible = torch.arange(ctx)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=case.scale)
        outs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def max_error(actual: Tensor, expected: Tensor) -> float:
    return float((actual.detach().cpu().double() - expected.cpu().double()).abs().max())


def check_write_kv(impl, gen: torch.Generator, dtype: torch.dtype, device) -> dict:
    """Write random tokens (some with slot -1) through ``impl`` and compare with the reference."""
    block_size = [8, 16, 32][int(torch.randint(3, (1,), generator=gen))]
    num_kv_heads = int(torch.randint(1, 5, (1,), generator=gen))
    head_dim = [16, 32, 64][int(torch.randint(3, (1,), generator=gen))]
    num_blocks = int(torch.randint(2, 9, (1,), generator=gen))
    num_slots = num_blocks * block_size
    num_tokens = int(torch.randint(1, num_slots + 1, (1,), generator=gen))
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    impl.write_kv(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    return {
        "kernel": "write_kv",
        "dtype": str(dtype).removeprefix("torch."),
        "num_tokens": num_tokens,
        "skipped_slots": int((slots < 0).sum()),
        "block_size": block_size,
        # Writes are copies: anything but bit-exact is a bug.
        "max_error": max(max_error(k_dev, k_ref), max_error(v_dev, v_ref)),
        "tolerance": 0.0,
    }


def check_attention(impl, gen: torch.Generator, kernel: str, dtype: torch.dtype, device) -> dict:
    """Compare ``impl``'s attention with the reference on a random case.

    ``kernel`` is ``decode``, ``prefill``, or ``decode_split``: decode over longer contexts cut
    into 64-token partitions, so that the partition merge runs on any device.
    """
    split = kernel == "decode_split"
    case = random_case(gen, decode=kernel != "prefill", dtype=dtype, device=device,
                       max_context=300 if split else 80)
    if kernel != "prefill" and len(case.q_lens) > 1 and torch.rand(1, generator=gen) < 0.3:
        # A padding sequence (context 0, as in a padded CUDA-graph batch) must yield zeros.
        case.context_lens[-1] = 0
    cpu = random_case_on_cpu(case)
    if kernel == "prefill":
        expected = reference.paged_prefill_attention(
            cpu.query, cpu.k_cache, cpu.v_cache, cpu.block_tables, cpu.query_start_loc,
            cpu.context_lens, cpu.scale,
        )
        actual = impl.paged_prefill_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
            case.context_lens, case.scale,
        )
    else:
        expected = reference.paged_decode_attention(
            cpu.query, cpu.k_cache, cpu.v_cache, cpu.block_tables, cpu.context_lens, cpu.scale
        )
        extra = {"partition_size": 64} if split else {}
        actual = impl.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
            case.scale, **extra,
        )
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{kernel}: got {tuple(actual.shape)} {actual.dtype}, "
            f"expected {tuple(expected.shape)} {expected.dtype}"
        )
    return {
        "kernel": kernel,
        **case.describe(),
        "max_error": max_error(actual, expected),
        "tolerance": TOLERANCE[dtype],
    }


# Element-wise ops round at the same points as their PyTorch forms: only the reductions' order and
# the transcendental functions' last bits may differ (relative error, by dtype). bfloat16 allows a
# few units in the last place because Triton's interpreter rounds it by truncation.
LAYER_OP_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def relative_error(actual: Tensor, expected: Tensor) -> float:
    expected = expected.cpu().double()
    return float(((actual.detach().cpu().double() - expected).abs() / (1 + expected.abs())).max())


def check_layer_op(gen: torch.Generator, kernel: str, dtype: torch.dtype, device) -> dict:
    """One random case of a Triton layer op (:mod:`kvscale.kernels.layer_ops_triton`) against
    its PyTorch form (:mod:`kvscale.kernels.layer_ops`)."""
    from kvscale.kernels import layer_ops, layer_ops_triton

    def pick(options: list) -> int:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    rows = int(torch.randint(1, 40, (1,), generator=gen))
    detail: dict = {"rows": rows}
    if kernel == "add_rms_norm":
        width = pick([64, 576, 1000])
        x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
        weight = (1 + 0.2 * torch.randn(width, generator=gen)).to(dtype)
        residual = torch.randn(rows, width, generator=gen).to(dtype) if pick([0, 1]) else None
        stream = None if residual is None else residual.clone()
        expected = layer_ops.torch_rms_norm(x if residual is None else residual.add_(x), weight, 1e-5)
        stream_dev = None if stream is None else stream.to(device)
        actual = layer_ops_triton.add_rms_norm(x.to(device), stream_dev, weight.to(device), 1e-5)
        errors = [relative_error(actual, expected)]
        if residual is not None:
            errors.append(relative_error(stream_dev, residual))  # the sum left in the stream
        detail |= {"width": width, "residual": residual is not None}
    elif kernel == "rope":
        head_dim, q_heads, kv_heads = pick([16, 64, 80]), pick([3, 9]), pick([1, 3])
        # The q|k heads as the model passes them: a view into the fused qkv rows (v left out).
        qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
        heads = qkv[:, : (q_heads + kv_heads) * head_dim].view(rows, -1, head_dim)
        angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
        cos = torch.cat([angles.cos()] * 2, -1).to(dtype)[:, None, :]
        sin = torch.cat([angles.sin()] * 2, -1).to(dtype)[:, None, :]
        expected = layer_ops.torch_rope(heads, cos, sin)
        qkv_dev = qkv.to(device)
        actual = layer_ops_triton.rope(qkv_dev[:, : (q_heads + kv_heads) * head_dim].view(rows, -1, head_dim),
                                       cos.to(device), sin.to(device))
        errors = [relative_error(actual, expected)]
        detail |= {"head_dim": head_dim, "heads": q_heads + kv_heads}
    else:
        width = pick([64, 1000, 1536])
        gate_up = (torch.randn(rows, 2 * width, generator=gen) * 3).to(dtype)
        expected = layer_ops.torch_silu_and_mul(gate_up)
        actual = layer_ops_triton.silu_and_mul(gate_up.to(device))
        errors = [relative_error(actual, expected)]
        detail |= {"width": width}
    if actual is None or actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{kernel}: got {actual if actual is None else (actual.shape, actual.dtype)}, "
                             f"expected {tuple(expected.shape)} {expected.dtype}")
    return {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), **detail,
            "max_error": max(errors), "tolerance": LAYER_OP_TOLERANCE[dtype]}


def random_case_on_cpu(case: PagedCase) -> PagedCase:
    fields = {name: getattr(case, name) for name in PagedCase.__dataclass_fields__}
    for name, value in fields.items():
        if isinstance(value, Tensor):
            fields[name] = value.cpu()
    return PagedCase(**fields)


ATTENTION_KERNELS = ["write_kv", "decode", "decode_split", "prefill"]
LAYER_OPS = ["add_rms_norm", "rope", "silu_and_mul"]
KERNELS = ATTENTION_KERNELS + LAYER_OPS + ["lora", "moe"]  # lora: lora_checks.py; moe: moe_checks.py


def run_checks(kernels: list[str], dtypes: list[torch.dtype], cases: int, seed: int,
               device: str) -> list[dict]:
    """Run ``cases`` random comparisons per kernel and dtype of the Triton kernels on ``device``.

    The backend :func:`kvscale.kernels.backend_for` picks is called, so the choice is checked
    too: on ``device`` it must pick Triton (CUDA, or ``KVSCALE_FORCE_TRITON=1``).
    """
    import kvscale.kernels as dispatch
    from kvscale.kernels import triton_kernels

    if not dispatch.use_triton(torch.device(device)):
        raise RuntimeError(
            f"kvscale.kernels would not use Triton on {device!r}: "
            "use a CUDA device or set KVSCALE_FORCE_TRITON=1 (with TRITON_INTERPRET=1 on CPU)"
        )
    results = []
    for kernel in kernels:
        # The partition size is not part of the ops' signature: call the launcher itself.
        impl = triton_kernels if kernel == "decode_split" else dispatch.backend_for(torch.device(device))
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(seed)
            for _ in range(cases):
                if kernel in LAYER_OPS:
                    result = check_layer_op(gen, kernel, dtype, device)
                elif kernel == "lora":
                    result = check_lora(gen, dtype, device)
                elif kernel == "moe":
                    result = check_moe(gen, dtype, device)
                elif kernel == "write_kv":
                    result = check_write_kv(impl, gen, dtype, device)
                else:
                    result = check_attention(impl, gen, kernel, dtype, device)
                result["ok"] = result["max_error"] <= result["tolerance"]
                results.append(result)
    return results


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="append", choices=KERNELS)
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    results = run_checks(
        args.kernel or KERNELS,
        [DTYPES[name] for name in args.dtype or ["float32"]],
        args.cases,
        args.seed,
        args.device,
    )
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
