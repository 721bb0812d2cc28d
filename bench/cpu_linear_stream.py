"""The bundled model's bfloat16 projections with their weights read from memory, as a decode step
reads them: oneDNN's packed GEMM against kvscale's AMX kernel (``kernels/cpu_linear_amx.c``).

``bench.cpu_linear`` times one layer's weights over and over, which the caches then hold; in a
step every layer has its own weights and the KV reads in between push them out. Here each of the
30 layers gets its own weights, a forward's projections run in the engine's order (qkv, o,
gate_up, down per layer, then the LM head where every row samples), and a 768 MB buffer is
written between timed forwards so that neither side starts from warm caches. The two sides
alternate within every repeat; figures are medians. ``server/cpu_linear.py`` takes its
``AMX_ROWS_MAX`` from where the ratio crosses 1.

    python -m bench.cpu_linear_stream --threads 2     # bench/results/cpu_linear_stream_t2.json
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import machine, op_bench_args, write_result
from bench.cpu_linear import DECODE_ROWS_MAX, projection_shapes
from kvscale.kernels import cpu_native
from kvscale.server.cpu_linear import PackedLinear

ROWS = (1, 8, 16, 32, 64, 128, 256, 512)
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
            layer.append((name, inp, out, PackedLinear(weight, None), amx_weight))
        layers.append(layer)
    evict = torch.ones(EVICT_BYTES // 4)
    weight_bytes = sum(out * inp * 2 for layer in layers for _, inp, out, _, _ in layer)
    rows_out = []
    for rows in ROWS:
        inputs = {inp: torch.randn(rows, inp, generator=gen).to(torch.bfloat16) for inp, _ in shapes.values()}
        with_head = rows <= DECODE_ROWS_MAX

        def onednn() -> None:
            for layer in layers[: None if with_head else num_layers]:
                for _, inp, _, packed, _ in layer:
                    packed(inputs[inp])

        def amx() -> None:
            for layer in layers[: None if with_head else num_layers]:
                for _, inp, out, _, amx_weight in layer:
                    cpu_native.linear_amx(inputs[inp], amx_weight, None, out)

        samples: dict[str, list[float]] = {"onednn": [], "amx": []}
        for _ in range(args.repeats):
            for side, forward in (("onednn", onednn), ("amx", amx)):
                evict.add_(1.0)
                started = time.perf_counter()
                forward()
                samples[side].append((time.perf_counter() - started) * 1000)
        onednn_ms, amx_ms = statistics.median(samples["onednn"]), statistics.median(samples["amx"])
        read = weight_bytes if with_head else weight_bytes - shapes["lm_head"][0] * shapes["lm_head"][1] * 2
        rows_out.append({"rows": rows, "lm_head": with_head, "weight_mb": read / 1e6, "onednn_ms": onednn_ms,
                         "amx_ms": amx_ms, "amx_over_onednn": amx_ms / onednn_ms,
                         "onednn_gb_s": read / onednn_ms / 1e6, "amx_gb_s": read / amx_ms / 1e6})
        row = rows_out[-1]
        print(f"rows {rows:4d}  oneDNN {onednn_ms:7.2f} ms ({row['onednn_gb_s']:4.1f} GB/s)  "
              f"AMX {amx_ms:7.2f} ms ({row['amx_gb_s']:4.1f} GB/s)  {row['amx_over_onednn']:.2f}x", flush=True)
    result = {"benchmark": "cpu_linear_stream", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "threads": args.threads, "repeats": args.repeats, "rows": rows_out}
    print(write_result(f"cpu_linear_stream_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
