"""The bundled model's projections on the CPU: torch's ``F.linear`` against oneDNN packed weights.

Same process, same inputs, for each row count a step can have (1: one stream decoding; 4-64:
batched decode; 256-2048: prefill chunks), float32 and bfloat16. A figure is one forward's
projections: qkv, o, gate_up and down of every layer, plus the LM head on decode-sized batches
(every row samples; prefill computes logits only for the rows that end a prompt). ``F.linear``
gets the layout the engine gave it before packing (float32: a transposed view of an [in, out]
buffer; bfloat16: the checkpoint's [out, in]). Medians of repeated calls; the ratio packed ÷
F.linear is what ``server/worker/cpu_linear.py`` decides by (below 1: packing is faster). Each row also
times ``--quantization int8``'s projection (``server/worker/quantization.py``: int8 weights, the input
quantized per row on each call) on inputs of that dtype, and its ratio to the faster of the two.
Where oneDNN has no bf16 kernels (an AVX2 CPU) bfloat16 cannot be packed: its rows time the
engine's widened projection (``WidenedLinear``) instead, and its ratio to float32's best layout.

    python -m bench.cpu_linear --threads 2      # bench/results/cpu_linear_t2.json
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional

from bench.common import machine, median_ms, op_bench_args, write_result
from kvscale.model_files import resolve_model_path
from kvscale.server.worker.cpu_linear import PackedLinear, WidenedLinear, onednn_packs
from kvscale.server.worker.model_llama import spec_from_hf_config
from kvscale.server.worker.quantization import Int8Linear

ROWS = (1, 4, 8, 16, 64, 256, 2048)
DECODE_ROWS_MAX = 64


def projection_shapes() -> tuple[dict[str, tuple[int, int]], int]:
    """(name -> (in, out)) for one layer and the LM head, and the layer count, of the bundled model."""
    import transformers

    spec = spec_from_hf_config(transformers.AutoConfig.from_pretrained(resolve_model_path(None)))
    q, kv, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    shapes = {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * spec.intermediate_size),
              "down": (spec.intermediate_size, hidden), "lm_head": (hidden, spec.vocab_size)}
    return shapes, spec.num_layers


def measure(dtype: torch.dtype, repeats: int, gen: torch.Generator) -> list[dict]:
    shapes, num_layers = projection_shapes()
    weights = {name: (torch.randn(out, inp, generator=gen) * 0.02).to(dtype) for name, (inp, out) in shapes.items()}
    plain = {name: w.t().contiguous().t() if dtype == torch.float32 else w for name, w in weights.items()}
    widens = dtype == torch.bfloat16 and not onednn_packs(dtype)
    layout = "widened" if widens else "packed"
    laid_out = {name: WidenedLinear(w, None) if widens else PackedLinear(w, None) for name, w in weights.items()}
    int8 = {name: Int8Linear(w, None) for name, w in weights.items()}
    rows_out = []
    for rows in ROWS:
        linear_ms = laid_out_ms = int8_ms = 0.0
        for name, (inp, _) in shapes.items():
            if name == "lm_head" and rows > DECODE_ROWS_MAX:
                continue
            x = torch.randn(rows, inp, generator=gen).to(dtype)
            times = 1 if name == "lm_head" else num_layers
            reps = max(5, repeats // 4) if rows >= 256 else repeats
            # torch's own bf16 GEMM without bf16 kernels takes seconds a call past a few rows: timed once.
            linear_reps, linear_warmup = (reps, 2) if not widens else (3, 1) if rows <= 16 else (1, 0)
            linear_ms += times * median_ms(lambda x=x, w=plain[name]: functional.linear(x, w), linear_reps,
                                           warmup=linear_warmup)
            laid_out_ms += times * median_ms(lambda x=x, m=laid_out[name]: m(x), reps, warmup=2)
            int8_ms += times * median_ms(lambda x=x, m=int8[name]: m(x), reps, warmup=2)
        rows_out.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "f_linear_ms": linear_ms,
                         f"{layout}_ms": laid_out_ms, f"{layout}_over_f_linear": laid_out_ms / linear_ms,
                         "int8_ms": int8_ms, "int8_over_best": int8_ms / min(linear_ms, laid_out_ms)})
    return rows_out


def main(argv: list[str] | None = None) -> int:
    args = op_bench_args(__doc__, argv)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows.extend(measure(dtype, args.repeats, gen))
    float32_best = {row["rows"]: min(row["f_linear_ms"], row["packed_ms"]) for row in rows if row["dtype"] == "float32"}
    for row in rows:
        if "widened_ms" in row:
            row["widened_over_float32"] = row["widened_ms"] / float32_best[row["rows"]]
    for row in rows:
        layout = "widened" if "widened_ms" in row else "packed"
        line = (f"{row['dtype']:9s} rows {row['rows']:5d}  F.linear {row['f_linear_ms']:8.2f} ms  "
                f"{layout} {row[f'{layout}_ms']:8.2f} ms  {row[f'{layout}_over_f_linear']:.2f}x  "
                f"int8 {row['int8_ms']:8.2f} ms  {row['int8_over_best']:.2f}x")
        if "widened_over_float32" in row:
            line += f"  widened / float32 {row['widened_over_float32']:.2f}x"
        print(line)
    result = {"benchmark": "cpu_linear", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "threads": args.threads, "engine_packs": {"float32": onednn_packs(torch.float32),
                                                        "bfloat16": onednn_packs(torch.bfloat16)},
              "rows": rows}
    print(write_result(f"cpu_linear_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
