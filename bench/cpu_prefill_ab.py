"""bfloat16 prefill attention (the AMX kernel, kernels/cpu_prefill_attention.c) of this tree
against another checkout's, in the same run: ``bench.cpu_kernels``' prefill rows (one layer of a
W1 and a W2 prefill step) measured by each tree's own code in its own process, the two processes
alternating round by round so that the machine's drift hits both alike.

    git worktree add /tmp/kv-before HEAD~1
    python -m bench.cpu_prefill_ab --before-checkout /tmp/kv-before --rounds 5

Writes ``bench/results/cpu_prefill_ab_t<threads>.json``: every round's rows and, per step, the
medians and the before ÷ after ratio of the C kernel's time (above 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import git_commit, machine, write_result
from bench.roofline import cpu_isa

REPO = Path(__file__).resolve().parents[1]

MEASURE = ("import json, torch; torch.set_num_threads({threads}); "
           "from bench.cpu_kernels import prefill_rows; "
           "print(json.dumps(prefill_rows(torch.Generator().manual_seed(0), {repeats})))")


def measure(checkout: Path, threads: int, repeats: int) -> list[dict]:
    """The prefill rows as ``checkout``'s code measures them (its kernel, built from its sources)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", MEASURE.format(threads=threads, repeats=repeats)],
                          cwd=checkout, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, list[dict]]]) -> dict[str, dict]:
    """Per op: each side's median C time over the rounds, and before ÷ after."""
    result: dict[str, dict] = {}
    for op in [row["op"] for row in rounds[0]["after"]]:
        medians = {side: statistics.median(row["c_ms"] for entry in rounds for row in entry[side] if row["op"] == op)
                   for side in ("before", "after")}
        result[op] = {"before_c_ms": medians["before"], "after_c_ms": medians["after"],
                      "before_over_after": medians["before"] / medians["after"]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-checkout", type=Path, required=True, help="the other tree (a git worktree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=31, help="timed calls per row and round (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    for round_id in range(args.rounds):
        order = ["before", "after"] if round_id % 2 == 0 else ["after", "before"]
        entry: dict = {"order": order}
        for side in order:
            entry[side] = measure(args.before_checkout if side == "before" else REPO, args.threads, args.repeats)
        rounds.append(entry)
        print(f"round {round_id}: " + ", ".join(
            f"{side} {row['op'].removeprefix('prefill attention, ')} {row['c_ms']:.3f} ms"
            for side in order for row in entry[side]), flush=True)
    summary = summarize(rounds)
    for op, figures in summary.items():
        print(f"{op}: before {figures['before_c_ms']:.3f} ms, after {figures['after_c_ms']:.3f} ms, "
              f"{figures['before_over_after']:.2f}x")
    result = {"benchmark": "cpu_prefill_ab", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {**machine(), "isa": cpu_isa()},
              "threads": args.threads, "commits": {"after": git_commit(REPO), "before": git_commit(args.before_checkout)}, "rounds": rounds, "summary": summary}
    print(write_result(f"cpu_prefill_ab_t{args.threads}", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
