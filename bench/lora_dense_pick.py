"""Which CPU form of the batched LoRA delta (kernels/lora.py's contract) is faster for one
projection of the bundled model: the reference's pair of matmuls per slot on its rows
(``torch_add_lora``), one shrink over every slot with each row keeping its own slot's columns
and one expand per fused slice (``kernels.lora_dense``), and each row's own matrices gathered for
two batched matmuls (``torch.bmm``, vLLM's CPU form), and, where the C kernels build, each row
through its own slot's matrices in C (``kernels.lora_cpu``, ``native_us``). Rows 16 to 1,024,
ranks 8 and 16, 8 slots held, all 8 or 2 of them on the rows (``--present``); the bundled model's four fused projections (q|k|v, o,
gate|up, down), B block-diagonal by their slices as the engine lays an adapter out.

Each form's time is the median of batches of calls (µs per call), with what
``kernels.lora_dense.choose_stacked`` picks for the case (``picked_stacked``): the cases
``kernels.lora_dense.CALL_MACS`` is checked against.

    python -m bench.lora_dense_pick        # about 3 minutes on 2 vCPUs

Writes bench/results/lora_dense_pick.json (command, machine, cases).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import write_result

# The bundled model's fused projections: (in, out, slices).
SHAPES = {"qkv_proj": (576, (576, 192, 192)), "o_proj": (576, (576,)), "gate_up_proj": (576, (1536, 1536)),
          "down_proj": (1536, (576,))}
SLOTS = 8


def per_call_us(action: Callable[[], object], budget_s: float) -> float:
    """Median over batches of calls of µs per call, about ``budget_s`` in all."""
    for _ in range(3):
        action()
    started = time.perf_counter()
    action()
    one = max(time.perf_counter() - started, 1e-6)
    calls = max(1, int(budget_s / 5 / one))
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            action()
        batches.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(batches)


def one_case(rows: int, rank: int, present: int, shape: tuple[int, tuple[int, ...]], dtype: Any,
             budget_s: float) -> dict[str, Any]:
    import torch

    from kvscale.kernels import lora_cpu
    from kvscale.kernels.lora import LoRASlots, lora_rows, torch_add_lora
    from kvscale.kernels.lora_dense import choose_stacked, dense_add_lora, stacked

    fin, widths = shape
    fout, slices = sum(widths), len(widths)
    layout = tuple((sum(widths[:j]), widths[j]) for j in range(slices)) if slices > 1 else ()
    gen = torch.Generator().manual_seed(rows * 31 + rank)
    k = slices * rank

    def block_diagonal(b: Any) -> Any:
        kept = torch.zeros_like(b)
        for j, (first, width) in enumerate(layout or ((0, fout),)):
            kept[first:first + width, j * rank:(j + 1) * rank] = b[first:first + width, j * rank:(j + 1) * rank]
        return kept

    pairs = tuple(((torch.randn(k, fin, generator=gen) * fin**-0.5).to(dtype),
                   block_diagonal(torch.randn(fout, k, generator=gen) * k**-0.5).to(dtype)) for _ in range(SLOTS))
    row_slots = [i % present for i in range(rows)]
    x = torch.randn(rows, fin, generator=gen).to(dtype)
    out = torch.zeros(rows, fout, dtype=dtype)
    plan, slots = lora_rows(row_slots, torch.device("cpu")), LoRASlots(pairs, layout)
    a_stack = torch.stack([a for a, _ in pairs])  # [S, k, in]
    b_stack = torch.stack([b for _, b in pairs])  # [S, out, k]
    index = torch.tensor(row_slots)

    def gather_bmm() -> None:
        out.add_(torch.bmm(b_stack[index], torch.bmm(a_stack[index], x[:, :, None]))[:, :, 0])

    stacked(slots, x, fout)
    timed = {"reference_us": per_call_us(lambda: torch_add_lora(out, x, plan, slots), budget_s),
             "dense_us": per_call_us(lambda: dense_add_lora(out, x, plan, slots), budget_s)}
    if lora_cpu.native_available():
        timed["native_us"] = per_call_us(lambda: lora_cpu.native_add_lora(out, x, plan, slots), budget_s)
    if rows <= 64:
        timed["gather_bmm_us"] = per_call_us(gather_bmm, budget_s)
    weight = torch.randn(fout, fin, generator=gen).to(dtype)
    timed["base_linear_us"] = per_call_us(lambda: torch.nn.functional.linear(x, weight), budget_s)
    return {"rows": rows, "rank": rank, "present": present, "columns": SLOTS * k,
            "picked_stacked": choose_stacked(plan, slots, fin, fout),
            "picked_native": lora_cpu.native_pays(rows, present, dtype, True, lora_cpu.native_available()), **timed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64,128,256,1024")
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--present", default=f"{SLOTS},2", help="how many of the slots the rows name")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=0.25, help="timing per form and case")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from bench.roofline import cpu_info

    torch.set_num_threads(args.threads)
    started = time.time()
    cases = []
    with torch.inference_mode():
        for dtype_name in args.dtype.split(","):
            dtype = getattr(torch, dtype_name)
            for name, shape in SHAPES.items():
                for rank in (int(r) for r in args.ranks.split(",")):
                    for rows in (int(r) for r in args.rows.split(",")):
                        for present in (int(p) for p in args.present.split(",")):
                            case = {"projection": name, "dtype": dtype_name,
                                    **one_case(rows, rank, present, shape, dtype, args.budget_s)}
                            print(case, file=sys.stderr, flush=True)
                            cases.append(case)
    wins = [c["rows"] * c["columns"] for c in cases if c["dense_us"] < c["reference_us"]]
    losses = [c["rows"] * c["columns"] for c in cases if c["dense_us"] >= c["reference_us"]]
    # Where the pick was the slower form, and by how much (its time over the faster's).
    mispicks = [{k: c[k] for k in ("projection", "rows", "rank", "present")}
                | {"slower_by": max(c["dense_us"], c["reference_us"]) / min(c["dense_us"], c["reference_us"])}
                for c in cases if c["picked_stacked"] != (c["dense_us"] < c["reference_us"])]
    result = {
        "benchmark": "lora_dense_pick",
        "command": " ".join(["python -m bench.lora_dense_pick", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "machine": cpu_info(),
        "parameters": {**vars(args), "slots": SLOTS},
        "largest_dense_win": max(wins, default=0),
        "smallest_dense_loss": min(losses, default=None),
        "mispicks": mispicks,
        "cases": cases,
        "elapsed_s": time.time() - started,
    }
    print(write_result("lora_dense_pick", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
