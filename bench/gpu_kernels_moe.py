"""GPU timing of the fused mixture-of-experts kernel (kernels/moe_triton.py) against its PyTorch
reference (kernels/moe.py's ``torch_fused_moe``, one expert at a time) on the same card, JSON out.

    python bench/gpu_kernels_moe.py                 # -> bench/results/gpu_kernels_moe.json
    python bench/gpu_kernels_moe.py --quick         # three token counts
    python bench/gpu_kernels_moe.py --tokens 1,64   # these token counts
    python bench/gpu_kernels.py --check-only        # the kernel's correctness ("moe" among its kernels)

One sparse layer shaped as Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8, each expert's
intermediate 768), bfloat16, random weights (one tensor per expert, as the engine's modules hold
them) and a random router's routing (softmax in float32, top-k, renormalized, the weights rounded
to bfloat16 as Qwen3-MoE does), at each token count: the kernel's and the reference's median
times, their ratio, the kernel's largest error against the reference, and what the kernel moved
and computed: the chosen experts' weight bytes (each read at least once) over its time, as a
fraction of the card's peak bandwidth, and its multiply-adds over its time. Timings are medians
from ``triton.testing.do_bench`` (which clears the L2 cache between runs). No figure is made up
without a GPU: the command refuses to run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class MoeLayer:
    hidden: int
    experts: int
    top_k: int
    inter: int  # each expert's intermediate size

    def expert_params(self) -> int:
        """One expert's weights: gate|up ``[2 * inter, hidden]`` and down ``[hidden, inter]``."""
        return 3 * self.hidden * self.inter


QWEN3_30B_A3B = MoeLayer(hidden=2048, experts=128, top_k=8, inter=768)
TOKENS = [1, 8, 32, 128, 512, 2048, 8192]  # a decode step's rows up to a long prefill chunk's
QUICK_TOKENS = [1, 128, 2048]


def token_counts(tokens: str, quick: bool) -> list[int]:
    """``--tokens`` (comma-separated), else the quick or the full list."""
    if tokens:
        counts = [int(t) for t in tokens.split(",") if t.strip()]
        if not counts or min(counts) < 1:
            raise ValueError(f"--tokens wants positive counts, got {tokens!r}")
        return counts
    return QUICK_TOKENS if quick else TOKENS


def expert_bytes_read(topk_ids: torch.Tensor, layer: MoeLayer, elem: int) -> int:
    """The weight bytes of the experts the routing chose: what the kernel must read at least once."""
    return int(torch.unique(topk_ids).numel()) * layer.expert_params() * elem


def multiply_adds(tokens: int, layer: MoeLayer) -> int:
    """Each (token, expert) pair's gate|up and down products."""
    return tokens * layer.top_k * layer.expert_params()


def bench_moe(layer: MoeLayer, tokens: int, peak_gbps: float | None, dtype: torch.dtype = torch.bfloat16) -> dict:
    import triton.testing

    from kvscale.kernels import moe_triton
    from kvscale.kernels.moe import ExpertWeights, torch_fused_moe

    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(dtype)

    weights = ExpertWeights(tuple(randn(2 * layer.inter, layer.hidden) for _ in range(layer.experts)),
                            tuple(randn(layer.hidden, layer.inter) for _ in range(layer.experts)))
    x = randn(tokens, layer.hidden) * layer.hidden**0.5
    probs = torch.softmax((x @ randn(layer.experts, layer.hidden).t()).float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, layer.top_k, dim=-1)
    topk_weights = (topk_weights / topk_weights.sum(dim=-1, keepdim=True)).to(dtype)
    expected = torch_fused_moe(x, weights, topk_weights, topk_ids)
    actual = moe_triton.fused_moe(x, weights, topk_weights, topk_ids)
    if actual is None:
        raise RuntimeError("the kernel declined the layer")
    error = float((actual.float() - expected.float()).abs().max())

    def timed(fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    kernel_ms = timed(lambda: moe_triton.fused_moe(x, weights, topk_weights, topk_ids))
    reference_ms = timed(lambda: torch_fused_moe(x, weights, topk_weights, topk_ids))
    elem = torch.finfo(dtype).bits // 8
    weight_bytes = expert_bytes_read(topk_ids, layer, elem)
    gbps = weight_bytes / (kernel_ms * 1e-3) / 1e9
    return {
        "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "experts_chosen": int(torch.unique(topk_ids).numel()),
        "kernel_ms_median": kernel_ms, "reference_ms_median": reference_ms,
        "speedup_vs_reference": reference_ms / kernel_ms, "max_abs_error_vs_reference": error,
        "expert_weight_bytes": weight_bytes, "weight_gbps": gbps,
        "weight_fraction_of_peak": gbps / peak_gbps if peak_gbps else None,
        "tflops": 2 * multiply_adds(tokens, layer) / (kernel_ms * 1e-3) / 1e12,
    }


def bench_moe_rows(quick: bool, tokens: str = "", peak_gbps: float | None = None,
                   layer: MoeLayer = QWEN3_30B_A3B) -> list[dict]:
    rows = []
    for count in token_counts(tokens, quick):
        row = bench_moe(layer, count, peak_gbps)
        rows.append(row)
        print("moe kernel", json.dumps(row), flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three token counts")
    parser.add_argument("--tokens", default="", help="comma-separated token counts (overrides --quick)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the card's peak memory bandwidth, if its name is not known to bench/gpu_kernels.py")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "gpu_kernels_moe.json")
    args = parser.parse_args(argv)
    token_counts(args.tokens, args.quick)  # refuses bad counts before any GPU work
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_kernels_moe.py needs a CUDA GPU: torch.cuda.is_available() is False here. "
              "No GPU figures were measured.", file=sys.stderr)
        return 2
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
    from gpu_kernels import peak_bandwidth_gbps

    device = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_bandwidth_gbps(device)
    report = {
        "benchmark": "gpu_kernels_moe", "date": dt.date.today().isoformat(), "device": device,
        "peak_bandwidth_gbps": peak, "host": platform.node(), "torch": torch.__version__,
        "triton": triton.__version__, "layer": {"shape_of": "Qwen3-30B-A3B", **asdict(QWEN3_30B_A3B)},
        "command": " ".join(["python", "bench/gpu_kernels_moe.py", *(argv if argv is not None else sys.argv[1:])]),
        "moe_kernel": bench_moe_rows(args.quick, args.tokens, peak),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
