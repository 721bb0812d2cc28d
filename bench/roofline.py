"""What the machine can do, to read engine figures against: the CPU's ISA, a measured GEMM
peak, and the useful FLOPs of a workload on a decoder.

Absolute tokens/s differ from machine to machine; achieved GFLOP/s as a fraction of a GEMM
peak measured in the same run does not, much.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

# lscpu flags that decide which GEMM and attention kernels a CPU build can use.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_isa() -> dict[str, Any]:
    """CPU model and the ISA flags that matter here (from ``lscpu``), plus torch's dispatch level."""
    info: dict[str, Any] = {"model_name": None, "flags": []}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            info["model_name"] = value.strip()
        elif key.strip() == "Flags":
            present = set(value.split())
            info["flags"] = [f for f in ISA_FLAGS if f in present]
    flags = set(info["flags"])
    info["summary"] = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else (
        "AVX2" if "avx2" in flags else "other")
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["torch_mkldnn"] = torch.backends.mkldnn.is_available()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def cpu_info() -> dict[str, Any]:
    """`common.machine` with the CPU's model and ISA flags, as the router benchmarks record it."""
    from bench.common import machine

    isa = cpu_isa()
    return {"cpu_model": isa["model_name"] or "", "isa_flags": isa["flags"], **machine()}


def gemm_peak(threads: int, dtype: str = "float32", size: int = 2048, seconds: float = 3.0) -> dict[str, Any]:
    """Best-of-several GFLOP/s of a square ``torch.matmul`` at this thread count. A bfloat16 peak
    where oneDNN has no bf16 kernels (an AVX2 CPU) is that of the GEMM the engine runs there, the
    inputs widened to float32 first (server/worker/cpu_linear.py): torch's own bf16 GEMM there runs at
    well under 1 GFLOP/s on this size, a peak no engine uses, and takes minutes to measure."""
    import torch

    from kvscale.server.worker.cpu_linear import onednn_packs

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    # The engine's own rule for when its bf16 projections are widened (WidenedLinear).
    widened = torch_dtype == torch.bfloat16 and not onednn_packs(torch_dtype)
    a = torch.randn(size, size).to(torch_dtype)
    b = torch.randn(size, size).to(torch_dtype)

    def product() -> object:
        return a.float() @ b.float() if widened else a @ b

    for _ in range(2):
        product()
    flop = 2 * size**3
    best = 0.0
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        start = time.perf_counter()
        product()
        rate = flop / (time.perf_counter() - start) / 1e9
        rates.append(rate)
        best = max(best, rate)
    rates.sort()
    return {"dtype": dtype, "threads": threads, "size": size, "best_gflops": best,
            "median_gflops": rates[len(rates) // 2], "runs": len(rates), "widened_to_float32": widened}


def memory_stream(threads: int, mib: int = 512, seconds: float = 1.0) -> dict[str, Any]:
    """GB/s of one read of a ``mib`` MiB float32 buffer (``torch.sum``) at this thread count, best
    and median of the passes made in ``seconds`` (at least three). A decode step reads every
    weight and the batch's K/V, so engines bound by their bytes move with this figure; shared
    VMs move it from one hour to the next (docs/performance.md, "How to read the figures"), so the runs record it beside their
    figures, before and after."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(mib * 1024 * 1024 // 4)
    buffer.sum()
    nbytes = buffer.numel() * 4
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        start = time.perf_counter()
        buffer.sum()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    rates.sort()
    return {"threads": threads, "bytes": nbytes, "best_gbps": rates[-1], "median_gbps": rates[len(rates) // 2],
            "runs": len(rates), "at": time.strftime("%H:%M:%S", time.gmtime())}


def decoder_flops(config: Any, prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    """Useful FLOPs to serve these requests on this decoder (a transformers config).

    Every fed token (the prompt, then each generated token but the last) goes through every
    projection (2 FLOPs per weight) and attends to all keys up to itself (QK^T and PV: 4 FLOPs per
    key per query-head dimension); each generated token needs one LM-head row. Padding,
    recomputation and embedding lookups are not useful work and are not counted.
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    layers = config.num_hidden_layers
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    linear = 2 * layers * per_layer
    lm_head = 2 * hidden * config.vocab_size
    fed_tokens = 0
    key_reads = 0  # sum over fed tokens of the keys each attends to
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o - 1
        fed_tokens += n
        key_reads += n * (n + 1) // 2
    attention = 4 * layers * heads * head_dim * key_reads
    total = linear * fed_tokens + attention + lm_head * sum(output_lens)
    return {"total_flop": float(total), "linear_flop": float(linear * fed_tokens),
            "attention_flop": float(attention), "lm_head_flop": float(lm_head * sum(output_lens)),
            "fed_tokens": float(fed_tokens)}
