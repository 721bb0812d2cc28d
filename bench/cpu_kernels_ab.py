"""One CPU attention kernel of this tree against another checkout's, in the same run, each
measured by its own tree's code in its own process, the two processes alternating round by round
so that the machine's drift hits both alike.

``--kernel prefill``: bfloat16 prefill attention (the AMX kernel, kernels/cpu_prefill_attention.c),
``bench.cpu_kernels``' prefill rows (one layer of a W1 and a W2 prefill step). ``--kernel decode``:
decode attention (kernels/cpu_decode_attention.c) on ``bench.cpu_kernels``' W1-like decode layer
over a bfloat16 cache (64 sequences, contexts 1-600: one layer's 15 MB read again and again, so
from L3 after the first call) and its 30-layer step (each layer's own cache, so from memory), the
latter in bfloat16 and in both FP8 formats.

    git worktree add /tmp/kv-before HEAD~1
    python -m bench.cpu_kernels_ab --kernel decode --before-checkout /tmp/kv-before --rounds 5

Writes ``bench/results/cpu_<kernel>_ab_t<threads>.json``: every round's rows and, per row, the
medians and the before ÷ after ratio of the C kernel's time (above 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench.before_after import (
    add_before_checkout,
    checkout_of,
    commits,
    median_ratio,
    order,
    run_json,
)
from bench.common import checkout_env, machine, write_result
from bench.roofline import cpu_isa

# What each side runs, with names both trees have (the other tree may predate this module).
MEASURE = {
    "prefill": ("import json, torch; torch.set_num_threads({threads}); "
                "from bench.cpu_kernels import prefill_rows; "
                "print(json.dumps(prefill_rows(torch.Generator().manual_seed(0), {repeats})))"),
    "decode": ("import json, torch; torch.set_num_threads({threads}); "
               "from bench.common import median_ms; from bench.cpu_kernels import decode_case, decode_step_rows; "
               "from kvscale.kernels import cpu_native; "
               "case = decode_case(torch.bfloat16, torch.Generator().manual_seed(0)); "
               "one = median_ms(lambda: cpu_native.paged_decode_attention(*case['args']), {repeats}, warmup=2); "
               "rows = [dict(op='decode attention, one layer (L3)', c_ms=one)] + [dict(op=row['op'], c_ms=row['c_ms']) "
               "for row in decode_step_rows(torch.Generator().manual_seed(1), max(3, {repeats} // 3))]; "
               "print(json.dumps(rows))"),
}


def measure(kernel: str, checkout: Path, threads: int, repeats: int) -> list[dict]:
    """``kernel``'s rows as ``checkout``'s code measures them (its kernel, built from its sources)."""
    code = MEASURE[kernel].format(threads=threads, repeats=repeats)
    return run_json([sys.executable, "-c", code], checkout, checkout_env(checkout, OMP_NUM_THREADS=str(threads)))


def summarize(rounds: list[dict[str, list[dict]]]) -> dict[str, dict]:
    """Per op: each side's median C time over the rounds, and before ÷ after."""
    result: dict[str, dict] = {}
    for op in [row["op"] for row in rounds[0]["after"]]:
        medians = median_ratio(rounds, lambda rows, op=op: next(row["c_ms"] for row in rows if row["op"] == op))
        result[op] = {"before_c_ms": medians["before"], "after_c_ms": medians["after"],
                      "before_over_after": medians["before_over_after"]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(MEASURE), required=True)
    add_before_checkout(parser, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=31, help="timed calls per row and round (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    for round_id in range(args.rounds):
        entry: dict = {"order": order(round_id)}
        for side in entry["order"]:
            entry[side] = measure(args.kernel, checkout_of(side, args.before_checkout), args.threads, args.repeats)
        rounds.append(entry)
        print(f"round {round_id}: " + ", ".join(
            f"{side} {row['op']} {row['c_ms']:.3f} ms"
            for side in entry["order"] for row in entry[side]), flush=True)
    summary = summarize(rounds)
    for op, figures in summary.items():
        print(f"{op}: before {figures['before_c_ms']:.3f} ms, after {figures['after_c_ms']:.3f} ms, "
              f"{figures['before_over_after']:.2f}x")
    result = {"benchmark": f"cpu_{args.kernel}_ab", "kernel": args.kernel, "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {**machine(), "isa": cpu_isa()},
              "threads": args.threads, "commits": commits(args.before_checkout),
              "rounds": rounds, "summary": summary}
    if args.kernel == "decode":
        # Whether this tree's decode rows ran on AMX tiles (the bundled model's bfloat16 shape).
        from kvscale.kernels import cpu_native

        result["after_on_amx"] = cpu_native.decode_attention_on_amx(torch.bfloat16, torch.bfloat16, 16, 9, 3, 64)
    print(write_result(f"cpu_{args.kernel}_ab_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
