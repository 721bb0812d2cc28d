"""GPU timing of the batched LoRA kernel (kernels/lora_triton.py) against its PyTorch reference
(kernels/lora.py's ``torch_add_lora``, the engine's CPU path) on the same card, JSON out.

    python bench/gpu_kernels_lora.py            # -> bench/results/gpu_kernels_lora.json
    python bench/gpu_kernels_lora.py --quick    # two configurations
    python bench/gpu_kernels.py                 # the same rows as its "lora_kernel" section

Each configuration is one projection's delta for a step whose rows are spread over ``adapters``
adapters of rank ``rank`` with a quarter of them base rows (the cases of
tests/kernels/lora_checks.py, at serving sizes): the kernel's and the reference's median times,
their ratio, the kernel's largest error against the reference, and the base projection's own GEMM
(``x @ W^T``) in the same run, so that the delta's cost can be read against what it is added to.
Timings are medians from ``triton.testing.do_bench`` (which clears the L2 cache between runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# (name, in features, width of a fused slice, slices): a projection's delta as the engine fuses it.
PROJECTIONS = [
    ("smollm2_135m_qkv", 576, 320, 3),  # 960 outputs (q 576 | k 192 | v 192) in three equal slices
    ("llama3_8b_qkv", 4096, 2048, 3),  # 6144 outputs (q 4096 | k 1024 | v 1024)
    ("llama3_8b_down", 14336, 4096, 1),
]
TOKENS = [1, 16, 64, 256, 2048]  # a decode step's rows up to a prefill chunk's


def bench_lora_kernel(projection: tuple[str, int, int, int], rows: int, adapters: int, rank: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict:
    import triton.testing

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from lora_checks import make_lora_case

    from kvscale.kernels import lora_triton
    from kvscale.kernels.lora import torch_add_lora

    name, in_features, slice_width, slices = projection
    gen = torch.Generator().manual_seed(0)
    case = make_lora_case(gen, dtype, rows=rows, in_features=in_features, slice_width=slice_width,
                          slices=slices, ranks=[rank] * adapters, base_share=0.25 if rows >= 16 else 0.0)
    x, out, lora_rows, lora_slots = case.on("cuda")
    expected = out.clone()
    torch_add_lora(expected, x, lora_rows, lora_slots)
    actual = out.clone()
    assert lora_triton.add_lora(actual, x, lora_rows, lora_slots), "the kernel declined the case"
    error = float((actual.float() - expected.float()).abs().max())
    weight = torch.randn(out.shape[1], in_features, device="cuda", dtype=dtype) * in_features**-0.5

    def timed(fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    kernel_ms = timed(lambda: lora_triton.add_lora(out, x, lora_rows, lora_slots))
    reference_ms = timed(lambda: torch_add_lora(out, x, lora_rows, lora_slots))
    base_ms = timed(lambda: x @ weight.t())
    return {
        "projection": name, "in_features": in_features, "out_features": out.shape[1], "rows": rows,
        "adapters": adapters, "rank": rank, "base_rows": sum(s < 0 for s in case.row_slots),
        "dtype": str(dtype).removeprefix("torch."),
        "kernel_ms_median": kernel_ms, "reference_ms_median": reference_ms,
        "speedup_vs_reference": reference_ms / kernel_ms, "base_gemm_ms_median": base_ms,
        "kernel_over_base_gemm": kernel_ms / base_ms, "max_abs_error_vs_reference": error,
    }


def lora_configs(quick: bool) -> list[tuple[tuple[str, int, int, int], int]]:
    if quick:
        return [(PROJECTIONS[1], 64), (PROJECTIONS[1], 2048)]
    return [(projection, rows) for projection in PROJECTIONS for rows in TOKENS]


def bench_lora_rows(quick: bool, adapters: int = 4, rank: int = 16) -> list[dict]:
    rows = []
    for projection, tokens in lora_configs(quick):
        row = bench_lora_kernel(projection, tokens, adapters, rank)
        rows.append(row)
        print("lora kernel", json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations")
    parser.add_argument("--adapters", type=int, default=4, help="adapters in the step (--max-loras)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "gpu_kernels_lora.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_kernels_lora.py needs a CUDA GPU: torch.cuda.is_available() is False here. "
              "No GPU figures were measured.", file=sys.stderr)
        return 2
    import triton

    report = {
        "benchmark": "gpu_kernels_lora", "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
        "triton": triton.__version__, "command": " ".join(["python", "bench/gpu_kernels_lora.py", *(argv or sys.argv[1:])]),
        "lora_kernel": bench_lora_rows(args.quick, args.adapters, args.rank),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
