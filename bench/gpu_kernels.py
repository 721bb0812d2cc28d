"""GPU microbenchmarks of the kvscale Triton kernels (needs CUDA), JSON out.

    python bench/gpu_kernels.py            # benchmarks -> bench/results/gpu_kernels.json
    python bench/gpu_kernels.py --check    # compiled kernels vs PyTorch references first

Two measurements, each beside a baseline taken in the same run:

1. Decode attention alone, bundled-model head shapes (9 query heads, 3 KV heads, head_dim 64),
   bfloat16 cache, block size 16: achieved memory bandwidth = (K/V bytes read + query, output
   and block-table bytes) / median kernel time, as a fraction of the card's peak bandwidth; and
   its speed against the PyTorch reference (gather + SDPA) on the same GPU.
2. A whole decode step with the bundled model's shapes (SmolLM2-135M: 30 layers, hidden 576,
   9 heads, 3 KV heads, head_dim 64, MLP 1536, vocab 49152, tied embeddings; random bfloat16
   weights), through the engine model's ops: time against the roofline (weight bytes + KV bytes
   read) / peak bandwidth, eagerly and as a CUDA graph, with the Triton layer ops and with their
   PyTorch forms, and against the same step using the PyTorch reference attention.
3. The batched LoRA kernel against its PyTorch reference, one projection's delta for a step of
   mixed adapters and base rows (bench/gpu_kernels_lora.py, which runs it alone too).

Timings are medians from ``triton.testing.do_bench`` (which clears the L2 cache between runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import platform
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Peak DRAM bandwidth in GB/s by device name (vendor datasheets); the first match wins.
PEAK_BANDWIDTH_GBPS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM5
    ("H800", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("T4", 320.0),
]


@dataclass(frozen=True)
class ModelShape:
    """The bundled model (SmolLM2-135M-Instruct)."""

    num_layers: int = 30
    hidden: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 49152

    def weight_params(self) -> int:
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden
        # Tied embeddings: the LM head reads the embedding matrix once per step.
        return self.num_layers * (qkv + o + mlp + norms) + self.hidden + self.vocab * self.hidden


MODEL = ModelShape()


def peak_bandwidth_gbps(name: str) -> float | None:
    for key, gbps in PEAK_BANDWIDTH_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


def median_ms(fn, *, graph: bool = False) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def paged_setup(num_seqs: int, context_len: int, shape: ModelShape, dtype: torch.dtype,
                block_size: int, num_layers: int, gen: torch.Generator):
    """Per-layer caches with every sequence at ``context_len`` tokens, blocks shuffled."""
    blocks_per_seq = math.ceil(context_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    # Filled on the GPU (gigabytes), from a seeded generator so that two setups are equal.
    cache_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,),
                                                                             generator=gen)))
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    caches = []
    for _ in range(num_layers):
        caches.append(tuple(
            torch.randn(cache_shape, generator=cache_gen, device="cuda").to(dtype)
            for _ in range(2)
        ))
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = order.view(num_seqs, blocks_per_seq).cuda()
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
    last = context_len - 1
    slot_mapping = (block_tables[:, last // block_size].long() * block_size
                    + last % block_size)
    return caches, block_tables, context_lens, slot_mapping


def bench_decode_kernel(num_seqs: int, context_len: int, peak_gbps: float | None,
                        partitions: list[int] | None = None) -> dict:
    import kvscale.kernels as kernels
    from kvscale.kernels import reference

    gen = torch.Generator().manual_seed(0)
    dtype, block_size = torch.bfloat16, 16
    caches, block_tables, context_lens, _ = paged_setup(
        num_seqs, context_len, MODEL, dtype, block_size, 1, gen
    )
    (k_cache, v_cache), = caches
    query = torch.randn(num_seqs, MODEL.num_heads, MODEL.head_dim, dtype=dtype, device="cuda")
    scale = MODEL.head_dim**-0.5

    triton = kernels.backend_for(query.device)

    def triton_call(partition_size: int | None = None):
        return triton.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                             context_lens, scale, partition_size=partition_size)

    def reference_call():
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                context_lens, scale)

    error = float((triton_call().float() - reference_call().float()).abs().max())
    kernel_ms = median_ms(triton_call)
    reference_ms = median_ms(reference_call)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * num_seqs * context_len * MODEL.num_kv_heads * MODEL.head_dim * elem
    io_bytes = 2 * query.numel() * elem + block_tables.numel() * 4 + context_lens.numel() * 4
    achieved_gbps = (kv_bytes + io_bytes) / (kernel_ms * 1e-3) / 1e9
    # The same kernel with the context split into partitions of each size (tokens), so the
    # default split can be chosen from measurements rather than guessed.
    by_partition = {size: median_ms(lambda size=size: triton_call(size)) for size in partitions or []}
    return {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "dtype": "bfloat16",
        "block_size": block_size,
        "bytes_moved": kv_bytes + io_bytes,
        "kernel_ms_median": kernel_ms,
        "achieved_gbps": achieved_gbps,
        "fraction_of_peak": achieved_gbps / peak_gbps if peak_gbps else None,
        "reference_ms_median": reference_ms,
        "speedup_vs_reference": reference_ms / kernel_ms,
        "max_abs_error_vs_reference": error,
        **({"kernel_ms_by_partition_size": by_partition} if by_partition else {}),
    }


@contextlib.contextmanager
def triton_layer_ops(enabled: bool) -> Iterator[None]:
    """Run the layer ops in Triton (True) or as their PyTorch forms (False, the same-run baseline)."""
    from kvscale.kernels import layer_ops

    layer_ops.TRITON_LAYER_OPS = enabled
    try:
        yield
    finally:
        layer_ops.TRITON_LAYER_OPS = True


class DecodeStep:
    """One decode step of a SmolLM2-135M-shaped model over paged KV, random weights, through the
    ops the engine's model calls (kvscale.kernels.layer_ops and the attention backend given)."""

    def __init__(self, num_seqs: int, context_len: int, attention, dtype=torch.bfloat16,
                 block_size: int = 16):
        gen = torch.Generator().manual_seed(0)
        s = MODEL
        self.attention = attention
        self.num_seqs = num_seqs

        def weight(*shape):
            return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(dtype).cuda()

        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {
                "qkv": weight((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.hidden),
                "o": weight(s.hidden, s.num_heads * s.head_dim),
                "gate_up": weight(2 * s.intermediate, s.hidden),
                "down": weight(s.hidden, s.intermediate),
                "norm1": torch.ones(s.hidden, dtype=dtype, device="cuda"),
                "norm2": torch.ones(s.hidden, dtype=dtype, device="cuda"),
            }
            for _ in range(s.num_layers)
        ]
        self.final_norm = torch.ones(s.hidden, dtype=dtype, device="cuda")
        (self.caches, self.block_tables, self.context_lens,
         self.slot_mapping) = paged_setup(num_seqs, context_len, s, dtype, block_size,
                                          s.num_layers, gen)
        self.tokens = torch.randint(s.vocab, (num_seqs,), generator=gen).cuda()
        positions = torch.full((num_seqs,), context_len - 1, device="cuda")
        inv_freq = 1.0 / (100000.0 ** (torch.arange(0, s.head_dim, 2, device="cuda")
                                        / s.head_dim))
        angles = positions[:, None].float() * inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)  # halves repeat, as the model's tables do
        self.cos = angles.cos().to(dtype)[:, None, :]
        self.sin = angles.sin().to(dtype)[:, None, :]

    def __call__(self) -> torch.Tensor:
        from kvscale.kernels import layer_ops

        s = MODEL
        x = self.embed[self.tokens]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        residual = x
        h = layer_ops.add_rms_norm(x, None, self.layers[0]["norm1"], 1e-5)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, self.caches, strict=True)):
            if i:
                h = layer_ops.add_rms_norm(x, residual, layer["norm1"], 1e-5)
            qkv = h @ layer["qkv"].T
            qk = layer_ops.rope(qkv[:, : q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim),
                                self.cos, self.sin)
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            self.attention.write_kv(qk[:, s.num_heads :], v, k_cache, v_cache, self.slot_mapping)
            attn = self.attention.paged_decode_attention(
                qk[:, : s.num_heads], k_cache, v_cache, self.block_tables, self.context_lens, s.head_dim**-0.5
            )
            h = layer_ops.add_rms_norm(attn.reshape(-1, q_size) @ layer["o"].T, residual, layer["norm2"], 1e-5)
            x = layer_ops.silu_and_mul(h @ layer["gate_up"].T) @ layer["down"].T
        x = layer_ops.add_rms_norm(x, residual, self.final_norm, 1e-5)
        return (x @ self.embed.T).argmax(-1)


def bench_decode_step(num_seqs: int, context_len: int, peak_gbps: float | None) -> dict:
    """The step eager and as a CUDA graph, with the Triton layer ops and, in the same run, with
    their PyTorch forms; and eager with the reference attention where that fits in memory."""
    import kvscale.kernels as kernels
    from kvscale.kernels import reference

    elem = 2  # bfloat16
    weight_bytes = MODEL.weight_params() * elem
    kv_read = (2 * MODEL.num_layers * num_seqs * context_len * MODEL.num_kv_heads
               * MODEL.head_dim * elem)
    logits_bytes = num_seqs * MODEL.vocab * elem
    roofline_bytes = weight_bytes + kv_read + logits_bytes
    roofline_ms = roofline_bytes / (peak_gbps * 1e9) * 1e3 if peak_gbps else None

    step = DecodeStep(num_seqs, context_len, kernels.backend_for(torch.device("cuda")))
    timings: dict = {}
    tokens: dict = {}
    for fused in (True, False):
        with triton_layer_ops(fused):
            tokens[fused] = step()
            name = "triton_layer_ops" if fused else "torch_layer_ops"
            timings[f"{name}_eager_ms_median"] = median_ms(step)
            try:
                timings[f"{name}_cuda_graph_ms_median"] = median_ms(step, graph=True)
            except Exception as exc:  # noqa: BLE001 - recorded in the JSON rather than hidden
                timings[f"{name}_cuda_graph_ms_median"] = None
                timings[f"{name}_cuda_graph_error"] = f"{type(exc).__name__}: {exc}"
    del step
    torch.cuda.empty_cache()
    reference_ms = token_agreement = None
    if num_seqs * context_len <= 64 * 4096:  # the reference gathers every context per call
        reference_step = DecodeStep(num_seqs, context_len, reference.REFERENCE)
        # Same weights and caches: the greedy tokens should agree up to bfloat16 near-ties.
        token_agreement = float((reference_step() == tokens[True]).float().mean())
        reference_ms = median_ms(reference_step)
        del reference_step
        torch.cuda.empty_cache()
    fused_times = [t for k, t in timings.items() if k.startswith("triton") and k.endswith("median") and t]
    best_ms = min(fused_times)
    return {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "weight_bytes": weight_bytes,
        "kv_bytes_read": kv_read,
        "roofline_ms": roofline_ms,
        **timings,
        "fraction_of_roofline": roofline_ms / best_ms if roofline_ms else None,
        "triton_layer_ops_greedy_agreement_with_torch_layer_ops": float((tokens[True] == tokens[False]).float().mean()),
        "reference_attention_eager_ms_median": reference_ms,
        "tokens_per_s": num_seqs / (best_ms * 1e-3),
        "greedy_token_agreement_with_reference": token_agreement,
    }


def run_checks(cases: int) -> dict:
    # The same comparisons the kernel tests make (test support, so it lives under tests/).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from kernel_checks import KERNELS
    from kernel_checks import run_checks as check

    results = check(KERNELS, [torch.float32, torch.bfloat16, torch.float16], cases, seed=7,
                    device="cuda")
    failures = [r for r in results if not r["ok"]]
    return {"cases": len(results), "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="first compare the compiled kernels with the PyTorch references")
    parser.add_argument("--check-only", action="store_true", help="only run the comparisons")
    parser.add_argument("--cases", type=int, default=20, help="random cases per kernel and dtype")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the card's peak memory bandwidth, if its name is not known here")
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--partitions", default="",
                        help="comma-separated partition sizes (tokens) to time the decode kernel "
                             "at beside its default split; skips the whole-step rows")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "gpu_kernels.json")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here. "
              "No GPU figures were measured.", file=sys.stderr)
        return 2

    device_name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_bandwidth_gbps(device_name)
    import triton

    report: dict = {
        "benchmark": "gpu_kernels",
        "date": dt.date.today().isoformat(),
        "device": device_name,
        "peak_bandwidth_gbps": peak,
        "peak_bandwidth_source": "--peak-gbps" if args.peak_gbps else "datasheet table",
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "model_shape": asdict(MODEL),
    }
    status = 0
    if args.check or args.check_only:
        report["check"] = run_checks(args.cases)
        print(f"check: {report['check']['cases']} cases, "
              f"{len(report['check']['failures'])} failures", flush=True)
        if report["check"]["failures"]:
            status = 1
            for failure in report["check"]["failures"]:
                print("  FAIL", json.dumps(failure), flush=True)
    if not args.check_only:
        if peak is None:
            print(f"unknown peak bandwidth for {device_name!r}: pass --peak-gbps for fractions",
                  file=sys.stderr)
        kernel_configs = [(1, 4096), (16, 2048), (64, 1024), (64, 4096), (256, 1024),
                          (256, 4096), (1, 32768)]
        step_configs = [(1, 512), (16, 1024), (64, 1024), (256, 1024), (64, 4096), (256, 4096)]
        if args.quick:
            kernel_configs, step_configs = kernel_configs[2:4], step_configs[2:3]
        partitions = [int(size) for size in args.partitions.split(",") if size]
        if partitions:
            step_configs = []
        # The clocks rise from idle under load: the first configuration must not time the ramp.
        warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(100):
            warm @ warm
        torch.cuda.synchronize()
        report["decode_kernel"] = []
        for num_seqs, context_len in kernel_configs:
            row = bench_decode_kernel(num_seqs, context_len, peak, partitions)
            report["decode_kernel"].append(row)
            print("decode kernel", json.dumps(row), flush=True)
        report["decode_step"] = []
        for num_seqs, context_len in step_configs:
            row = bench_decode_step(num_seqs, context_len, peak)
            report["decode_step"].append(row)
            print("decode step", json.dumps(row), flush=True)
        if not partitions:
            sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
            from gpu_kernels_lora import bench_lora_rows

            report["lora_kernel"] = bench_lora_rows(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
