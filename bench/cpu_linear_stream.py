"""The bundled model's bfloat16 projections with their weights read from memory, as a decode step
reads them: oneDNN's packed GEMM against kvscale's AMX kernel (``kernels/cpu_linear_amx.c``);
and the same for ``--quantization int8``'s projections (``server/worker/quantization.py``'s
``Int8Linear`` on bfloat16 activations: oneDNN's int8 GEMM, or the kernel's int8 path).

``bench.cpu_linear`` times one layer's weights over and over, which the caches then hold; in a
step every layer has its own weights and the KV reads in between push them out. Here each of the
30 layers gets its own weights, a forward's projections run in the engine's order (qkv, o,
gate_up, down per layer, then the LM head where every row samples), and a 768 MB buffer is
written between timed forwards so that neither side starts from warm caches. The two sides
alternate within every repeat; figures are medians. ``server/worker/cpu_linear.py`` takes its
``AMX_ROWS_MAX`` from where the ratio crosses 1.

    python -m bench.cpu_linear_stream --threads 2     # bench/results/cpu_linear_stream_t2.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from bench.common import machine, op_bench_args, write_result
from bench.cpu_linear import DECODE_ROWS_MAX, projection_shapes
from kvscale.kernels import cpu_native
from kvscale.server.worker.cpu_linear import AMX_ROWS_MAX, PackedLinear
from kvscale.server.worker.quantization import Int8Linear

ROWS = (1, 8, 16, 32, 64, 128, 256, 512)


class Projection(NamedTuple):
    in_features: int
    out_features: int
    onednn: PackedLinear
    amx_weight: torch.Tensor
    int8_onednn: Int8Linear
    int8_amx: Int8Linear


# Each side: one projection of a forward on its input.
SIDES: dict[str, Callable[[Projection, torch.Tensor], object]] = {
    "onednn": lambda p, x: p.onednn(x),
    "amx": lambda p, x: cpu_native.linear_amx(x, p.amx_weight, None, p.out_features),
    "int8_onednn": lambda p, x: p.int8_onednn(x),
    "int8_amx": lambda p, x: p.int8_amx(x),
}
EVICT_BYTES = 768 << 20


def main(argv: list[str] | None = None) -> int:
    args = op_bench_args(__doc__, argv)
    if not cpu_native.amx_linear_available():
        raise SystemExit("this CPU (or this build) has no AMX bf16 tiles: nothing to compare")
    shapes, num_layers = projection_shapes()
    gen = torch.Generator().manual_seed(0)
    layers = []
    for index in range(num_layers + 1):
        names = ["lm_head"] if index == num_layers else [n for n in shapes if n != "lm_head"]
        layer = []
        for name in names:
            inp, out = shapes[name]
            weight = (torch.randn(out, inp, generator=gen) * 0.02).to(torch.bfloat16)
            amx_weight = cpu_native.pack_linear_amx(weight)
            assert amx_weight is not None, f"{name} {tuple(weight.shape)} is not made of 32-wide blocks"
            int8_amx = Int8Linear(weight, None)
            int8_onednn = Int8Linear(weight, None)
            int8_onednn.amx_weight = None  # Int8Linear's oneDNN path, as on a CPU without AMX tiles
            assert int8_amx.amx_weight is not None
            layer.append(Projection(inp, out, PackedLinear(weight, None), amx_weight, int8_onednn, int8_amx))
        layers.append(layer)
    evict = torch.ones(EVICT_BYTES // 4)
    weight_bytes = sum(p.out_features * p.in_features * 2 for layer in layers for p in layer)
    rows_out = []
    for rows in ROWS:
        inputs = {inp: torch.randn(rows, inp, generator=gen).to(torch.bfloat16) for inp, _ in shapes.values()}
        with_head = rows <= DECODE_ROWS_MAX

        active = layers if with_head else layers[:num_layers]
        samples: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):
            for side, call in SIDES.items():
                evict.add_(1.0)
                started = time.perf_counter()
                for layer in active:
                    for projection in layer:
                        call(projection, inputs[projection.in_features])
                samples[side].append((time.perf_counter() - started) * 1000)
        ms = {side: statistics.median(values) for side, values in samples.items()}
        read = weight_bytes if with_head else weight_bytes - shapes["lm_head"][0] * shapes["lm_head"][1] * 2
        # Past AMX_ROWS_MAX, Int8Linear runs oneDNN on both sides: the int8 pair then times the same code.
        rows_out.append({"rows": rows, "lm_head": with_head, "weight_mb": read / 1e6, "onednn_ms": ms["onednn"],
                         "amx_ms": ms["amx"], "amx_over_onednn": ms["amx"] / ms["onednn"],
                         "onednn_gb_s": read / ms["onednn"] / 1e6, "amx_gb_s": read / ms["amx"] / 1e6,
                         "int8_onednn_ms": ms["int8_onednn"], "int8_amx_ms": ms["int8_amx"],
                         "int8_amx_over_onednn": ms["int8_amx"] / ms["int8_onednn"],
                         "int8_amx_active": rows <= AMX_ROWS_MAX})
        row = rows_out[-1]
        print(f"rows {rows:4d}  bf16: oneDNN {ms['onednn']:7.2f} ms ({row['onednn_gb_s']:4.1f} GB/s)  "
              f"AMX {ms['amx']:7.2f} ms ({row['amx_gb_s']:4.1f} GB/s)  {row['amx_over_onednn']:.2f}x   "
              f"int8: oneDNN {ms['int8_onednn']:7.2f} ms  AMX {ms['int8_amx']:7.2f} ms  "
              f"{row['int8_amx_over_onednn']:.2f}x", flush=True)
    result = {"benchmark": "cpu_linear_stream", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "threads": args.threads, "repeats": args.repeats, "rows": rows_out}
    print(write_result(f"cpu_linear_stream_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
