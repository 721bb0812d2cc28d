"""The CPU C kernels against the PyTorch ops they replace, same process, same tensors.

Decode attention: a W1-like decode step's layer (64 sequences, contexts drawn from 1–600 tokens,
the bundled model's 9 query / 3 KV heads of 64, 16-token blocks scattered over a 2 GiB-sized
cache so K/V come from memory, not cache) through `cpu_native.paged_decode_attention` and through
`reference.paged_decode_attention`; reported with the K/V bytes read per second. Layer ops: SiLU-
and-multiply and residual-add + RMSNorm on a 2048-token prefill's activations against the torch
ops the model ran before, and RoPE on the q|k heads of a 2048-token step's fused qkv rows against
the model's PyTorch formula. Prefill attention of a W1 and a W2 prefill step's layer (float32:
the C kernel on AVX2 CPUs; bfloat16: on AMX CPUs; elsewhere both sides are the reference),
with GFLOP/s of causal work on each side. Medians of repeated calls,
float32 and bfloat16. The KV write of a decode and a prefill step's tokens. Also the sampler's
greedy ids (``server.sampler.greedy_tokens``, ``max(dim).indices``) against ``argmax`` on a
64-row decode step's float32 logits over the bundled model's vocabulary, and on a bfloat16
model's logits (64 and 256 rows) as they are against a float32 copy first (the engine's way
before). With a bfloat16 model, the FP8 KV cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): the same decode and prefill
steps and KV writes over the same values quantized, each row also against the bfloat16 cache's
C time (``vs_bf16_cache``: above 1, the FP8 cache is faster). The one-layer decode case reads the
same 15 MB every call, which stays in a large L3 (this Xeon's is 480 MiB); "30 layers" runs a
whole decode step's attention instead, 30 layers' caches one after the other (0.9 GB of
bfloat16 K/V), so each layer reads its K/V from memory as the engine's do.

    python -m bench.cpu_kernels --threads 1      # bench/results/cpu_kernels_t1.json
"""

from __future__ import annotations

import functools
import time

import torch

from bench.common import machine, median_ms, op_bench_args, write_result
from kvscale.kernels import cpu_native, fp8, reference
from kvscale.kernels.layer_ops import torch_rope
from kvscale.server.worker.sampler import greedy_tokens


def decode_case(dtype: torch.dtype, gen: torch.Generator) -> dict:
    num_seqs, num_heads, num_kv_heads, head_dim, block_size = 64, 9, 3, 64, 16
    num_blocks = 8192  # 8192 blocks x 16 tokens x 3 heads x 64 x 4 B x 2 = 200 MB of fp32 K/V
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.randint(1, 601, (num_seqs,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * 38].view(num_seqs, 38).to(torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    args = (query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    kv_bytes = int(lens.sum()) * num_kv_heads * head_dim * k_cache.element_size() * 2
    return {"args": args, "kv_bytes": kv_bytes, "mean_context": float(lens.float().mean())}


def measure(dtype: torch.dtype, gen: torch.Generator, repeats: int) -> list[dict]:
    rows: list[dict] = []
    case = decode_case(dtype, gen)
    native = median_ms(lambda: cpu_native.paged_decode_attention(*case["args"]), repeats, warmup=1)
    ref = median_ms(lambda: reference.paged_decode_attention(*case["args"]), repeats, warmup=1)
    rows.append({"op": "paged_decode_attention", "dtype": str(dtype), "c_ms": native, "torch_ms": ref,
                 "speedup": ref / native, "c_kv_gb_per_s": case["kv_bytes"] / native / 1e6,
                 "mean_context": case["mean_context"]})
    # A sharp head: scores tens apart, most softmax weights far below each row's peak (the C
    # kernel cuts them to exact zeros rather than subnormals).
    query, *rest = case["args"]
    peaked = (query * 40, *rest)
    native = median_ms(lambda: cpu_native.paged_decode_attention(*peaked), repeats, warmup=1)
    ref = median_ms(lambda: reference.paged_decode_attention(*peaked), repeats, warmup=1)
    rows.append({"op": "paged_decode_attention, peaked scores", "dtype": str(dtype), "c_ms": native,
                 "torch_ms": ref, "speedup": ref / native})

    gate_up = torch.randn(2048, 2 * 1536, generator=gen).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    native = median_ms(lambda: cpu_native.silu_and_mul(gate_up), repeats, warmup=1)
    ref = median_ms(lambda: torch.nn.functional.silu(gate) * up, repeats, warmup=1)
    rows.append({"op": "silu_and_mul [2048, 2x1536]", "dtype": str(dtype), "c_ms": native, "torch_ms": ref,
                 "speedup": ref / native})

    x = torch.randn(2048, 576, generator=gen).to(dtype)
    residual = torch.randn(2048, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)

    def torch_add_norm() -> torch.Tensor:
        summed = residual + x
        if dtype == torch.float32:
            return torch.nn.functional.rms_norm(summed, weight.shape, weight, 1e-5)
        normed = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return weight * normed.to(dtype)

    stream = residual.clone()
    native = median_ms(lambda: cpu_native.add_rms_norm(x, stream, weight, 1e-5), repeats, warmup=1)
    ref = median_ms(torch_add_norm, repeats, warmup=1)
    rows.append({"op": "add + rms_norm [2048, 576]", "dtype": str(dtype), "c_ms": native, "torch_ms": ref,
                 "speedup": ref / native})
    qkv = torch.randn(2048, (9 + 6) * 64, generator=gen).to(dtype)
    heads = qkv[:, : 12 * 64].view(2048, 12, 64)
    angles = torch.rand(2048, 32, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    native = median_ms(lambda: cpu_native.rope(heads, cos, sin), repeats, warmup=1)
    ref = median_ms(lambda: torch_rope(heads, cos, sin), repeats, warmup=1)
    rows.append({"op": "rope q|k [2048, 12, 64]", "dtype": str(dtype), "c_ms": native, "torch_ms": ref,
                 "speedup": ref / native})
    for tokens in (64, 2048):  # a decode step's and a prefill step's new K/V, into a 2048-block cache
        k_cache = torch.zeros(2048, 16, 3, 64, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        kv = torch.randn(tokens, 6, 64, generator=gen).to(dtype)
        slots = torch.randperm(2048 * 16, generator=gen)[:tokens]
        args = (kv[:, :3], kv[:, 3:], k_cache, v_cache, slots)
        native = median_ms(functools.partial(cpu_native.write_kv, *args), repeats, warmup=1)
        ref = median_ms(functools.partial(reference.write_kv, *args), repeats, warmup=1)
        rows.append({"op": f"write_kv {tokens} tokens", "dtype": str(dtype), "c_ms": native, "torch_ms": ref,
                     "speedup": ref / native})
    rows.extend(prefill_rows(gen, repeats, dtype=dtype, cache_dtype=dtype))
    if dtype == torch.bfloat16:
        rows.extend(fp8_rows(case, rows, gen, repeats))
        rows.extend(decode_step_rows(gen, max(3, repeats // 3)))
    return rows


def decode_step_rows(gen: torch.Generator, repeats: int, num_layers: int = 30) -> list[dict]:
    """A decode step's attention: the W1-like decode case over ``num_layers`` layers' own caches
    in turn (each just the 64 sequences' blocks), bfloat16 and each FP8 format; per layer."""
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, blocks_per_seq = 64, 9, 3, 64, 16, 38
    num_blocks = num_seqs * blocks_per_seq
    lens = torch.randint(1, 601, (num_seqs,), generator=gen, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    layers = []
    for _ in range(num_layers):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, blocks_per_seq).to(torch.int32)
        layers.append((torch.randn(shape, generator=gen).to(torch.bfloat16),
                       torch.randn(shape, generator=gen).to(torch.bfloat16), tables))
    kv_values = int(lens.sum()) * num_kv_heads * head_dim * 2

    def step(caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for k_cache, v_cache, tables in caches:
            cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim**-0.5)

    rows = []
    bf16_ms = median_ms(functools.partial(step, layers), repeats, warmup=1) / num_layers
    rows.append({"op": f"paged_decode_attention, {num_layers} layers", "dtype": str(torch.bfloat16),
                 "c_ms": bf16_ms, "torch_ms": float("nan"), "speedup": float("nan"),
                 "c_kv_gb_per_s": kv_values * 2 / bf16_ms / 1e6})
    for dtype in fp8.FP8_DTYPES:
        quantized = [(fp8.quantize(k, dtype, 1.0), fp8.quantize(v, dtype, 1.0), t) for k, v, t in layers]
        c_ms = median_ms(functools.partial(step, quantized), repeats, warmup=1) / num_layers
        rows.append({"op": f"paged_decode_attention, {num_layers} layers, KV {_fp8_name(dtype)}",
                     "dtype": str(torch.bfloat16), "c_ms": c_ms, "torch_ms": float("nan"), "speedup": float("nan"),
                     "c_kv_gb_per_s": kv_values / c_ms / 1e6, "vs_bf16_cache": bf16_ms / c_ms})
        del quantized
    return rows


def _fp8_name(dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[dtype]


def fp8_rows(case: dict, bf16_rows: list[dict], gen: torch.Generator, repeats: int) -> list[dict]:
    """The bfloat16 decode case, prefill steps and KV writes with the cache in each FP8 format."""
    rows: list[dict] = []
    bf16_c_ms = {row["op"]: row["c_ms"] for row in bf16_rows}
    query, k_cache, v_cache, *rest = case["args"]
    for dtype in fp8.FP8_DTYPES:
        name = _fp8_name(dtype)
        k8, v8 = fp8.quantize(k_cache, dtype, 1.0), fp8.quantize(v_cache, dtype, 1.0)
        args = (query, k8, v8, *rest)
        native = median_ms(functools.partial(cpu_native.paged_decode_attention, *args), repeats, warmup=1)
        ref = median_ms(functools.partial(reference.paged_decode_attention, *args), repeats, warmup=1)
        rows.append({"op": f"paged_decode_attention, KV {name}", "dtype": str(torch.bfloat16), "c_ms": native,
                     "torch_ms": ref, "speedup": ref / native, "c_kv_gb_per_s": case["kv_bytes"] / 2 / native / 1e6,
                     "vs_bf16_cache": bf16_c_ms["paged_decode_attention"] / native})
        for tokens in (64, 2048):
            k_dest = torch.zeros(2048, 16, 3, 64, dtype=dtype)
            v_dest = torch.zeros_like(k_dest)
            kv = torch.randn(tokens, 6, 64, generator=gen).to(torch.bfloat16)
            slots = torch.randperm(2048 * 16, generator=gen)[:tokens]
            write = (kv[:, :3], kv[:, 3:], k_dest, v_dest, slots)
            native = median_ms(functools.partial(cpu_native.write_kv, *write), repeats, warmup=1)
            ref = median_ms(functools.partial(reference.write_kv, *write), repeats, warmup=1)
            rows.append({"op": f"write_kv {tokens} tokens, KV {name}", "dtype": str(torch.bfloat16), "c_ms": native,
                         "torch_ms": ref, "speedup": ref / native,
                         "vs_bf16_cache": bf16_c_ms[f"write_kv {tokens} tokens"] / native})
        for row in prefill_rows(gen, repeats, dtype):
            row["op"] += f", KV {name}"
            row["vs_bf16_cache"] = bf16_c_ms[row["op"].removesuffix(f", KV {name}")] / row["c_ms"]
            rows.append(row)
    return rows


# (name, context lens, new tokens, shared prefix tokens): a W1 prefill step's prompts (2048
# tokens of 8 prompts of 60-512) and W2's chunks (16 requests' 64 own tokens after a cached
# 1024-token prefix, whose blocks they share as prefix caching has them).
PREFILL_STEPS = (
    ("W1 step, 8 prompts", [480, 100, 350, 250, 512, 60, 200, 96], [480, 100, 350, 250, 512, 60, 200, 96], 0),
    ("W2 step, 16 x 64 after 1024", [1088] * 16, [64] * 16, 1024),
)


def prefill_rows(gen: torch.Generator, repeats: int, cache_dtype: torch.dtype = torch.bfloat16,
                 dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Prefill attention of one layer in ``dtype`` (9 query / 3 KV heads of 64, 16-token blocks
    scattered over the cache, in ``cache_dtype``: ``dtype`` or, with bfloat16, an FP8 one): the C
    kernel (AMX for bfloat16, AVX2 for float32) against what the engine ran before it (the
    reference: one gather and one SDPA per group of equal sequences)."""
    rows = []
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 8192
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    if fp8.is_fp8(cache_dtype):
        k_cache, v_cache = fp8.quantize(k_cache, cache_dtype, 1.0), fp8.quantize(v_cache, cache_dtype, 1.0)
    for name, context_lens, q_lens, shared in PREFILL_STEPS:
        blocks = [-(-n // block_size) for n in context_lens]
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
        prefix_blocks = shared // block_size
        tables[:, :prefix_blocks] = order[:prefix_blocks]
        used = prefix_blocks
        for i, count in enumerate(blocks):
            tables[i, prefix_blocks:count] = order[used : used + count - prefix_blocks]
            used += count - prefix_blocks
        query = torch.randn(sum(q_lens), num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
        args = (query[:, :num_heads], k_cache, v_cache, tables,
                torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32),
                torch.tensor(context_lens, dtype=torch.int32), head_dim**-0.5)
        native = median_ms(functools.partial(cpu_native.paged_prefill_attention, *args), repeats, warmup=1)
        ref = median_ms(functools.partial(reference.paged_prefill_attention, *args,
                                          decode=cpu_native.paged_decode_attention), repeats, warmup=1)
        # Causal attention's multiply-adds: each new token against its position + 1 keys.
        flops = sum(4 * num_heads * head_dim * (q * (c - q) + q * (q + 1) / 2) for c, q in zip(context_lens, q_lens, strict=True))
        in_c = cpu_native.amx_prefill_available() if dtype == torch.bfloat16 else cpu_native.f32_prefill_available()
        rows.append({"op": f"prefill attention, {name}", "dtype": str(dtype), "c_ms": native,
                     "torch_ms": ref, "speedup": ref / native, "c_gflop_per_s": flops / native / 1e6,
                     "torch_gflop_per_s": flops / ref / 1e6, "in_c": in_c})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = op_bench_args(__doc__, argv)
    if not cpu_native.available():
        raise SystemExit("the C kernels did not build here (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for dtype in (torch.float32, torch.bfloat16):
        rows.extend(measure(dtype, gen, args.repeats))
    for row in rows:
        print(f"{row['op']:32s} {row['dtype']:15s} C {row['c_ms']:7.3f} ms  torch {row['torch_ms']:7.3f} ms"
              f"  {row['speedup']:.2f}x")
    logits = torch.randn(64, 49152, generator=gen)
    greedy = {"greedy_tokens_ms": median_ms(lambda: greedy_tokens(logits), args.repeats, warmup=1),
              "argmax_ms": median_ms(lambda: logits.argmax(dim=1), args.repeats, warmup=1)}
    greedy["speedup"] = greedy["argmax_ms"] / greedy["greedy_tokens_ms"]
    print(f"greedy ids [64, 49152] float32: max(dim).indices {greedy['greedy_tokens_ms']:.3f} ms  "
          f"argmax {greedy['argmax_ms']:.3f} ms  {greedy['speedup']:.2f}x")
    # A bfloat16 model's logits: the sampler argmaxes them as they are; before, the runner made a
    # float32 copy of every row first. Both at a decode step of 64 and of 256 sequences.
    for num_rows in (64, 256):
        bf16 = torch.randn(num_rows, 49152, generator=gen).bfloat16()
        as_is = median_ms(lambda x=bf16: greedy_tokens(x), args.repeats, warmup=1)
        copied = median_ms(lambda x=bf16: greedy_tokens(x.float()), args.repeats, warmup=1)
        greedy[f"bf16_{num_rows}_rows"] = {"as_is_ms": as_is, "float32_copy_ms": copied, "speedup": copied / as_is}
        print(f"greedy ids [{num_rows}, 49152] bfloat16: as they are {as_is:.3f} ms  "
              f"float32 copy first {copied:.3f} ms  {copied / as_is:.2f}x")
    result = {"benchmark": "cpu_kernels", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "threads": args.threads, "rows": rows, "greedy_ids": greedy}
    print(write_result(f"cpu_kernels_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
