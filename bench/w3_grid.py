"""The routing grid: kvscale's default policy against round-robin and `vllm-router` cache_aware
in every cell of what the earlier router runs held fixed (bench.w3_grid_cells: concurrency,
prefix length, groups against fleet capacity, replica speed, arrival order), hit rate, TTFT
p50/p90 and wall time, each cell's routers in the same run.

    python -m bench.w3_grid                            # simulated fleet, every cell (minutes)
    python -m bench.w3_grid --mode real --cells w3-lite   # real fleet, the held-out W3-lite cell
    python -m bench.w3_grid --previous predicted-ttft/rawqueue   # and the default before its last change
    python -m bench.w3_grid --max-num-seqs 4 --previous predicted-ttft/noslot   # batches that fill
    python -m bench.w3_grid --seeds 30 --before-checkout /tmp/kv-before   # and the parent commit's default
    python -m bench.w3_grid --seeds 30 --jobs 2     # cells over two processes (same figures)
    python -m bench.w3_grid --mode real --cells c4-p256-over-uniform-random --streams 3 --update   # one row anew

``--mode sim`` runs the calibrated fleet simulator (bench.w3_sim) with the real router's decision
functions and a model of cache_aware (bench.w3_cache_aware); ``--mode real`` starts replicas,
Redis and the real routers (bench.w3_grid_real; `vllm-router` comes from the bench extra:
``pip install -e '.[bench-routing]'``). ``--cells`` picks cells by name (comma-separated; ``w3-lite``,
or names as the JSON writes them, e.g. ``c8-p512-fits-throttled-random``), else every cell.
Writes bench/results/w3_grid_<mode>.json: the command, the machine (CPU model, ISA flags), each
cell's figures and, per cell, the default policy against the best of the other two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from bench.before_after import add_before_checkout
from bench.common import REPO, RESULTS, checkout_env, git_commit
from bench.w3_grid_cells import (
    POLICIES,
    W3_LITE,
    Cell,
    grid,
    seed_verdicts,
    simulate_cell,
    verdict,
)

OURS = {"sim": "predicted-ttft", "real": "kvscale:predicted-ttft"}
BASELINES = {"sim": ("round-robin", "vllm-router-cache-aware"),
             "real": ("kvscale:round-robin", "vllm-router:cache_aware")}


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def write_compact(name: str, record: dict[str, Any], out: str | None) -> Path:
    """The JSON with one line per cell (a hundred cells stay small in bench/results)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    head = {k: v for k, v in record.items() if k != "cells"}
    cells = ",\n".join("  " + json.dumps(rounded(cell), separators=(",", ":")) for cell in record["cells"])
    path.write_text(json.dumps(head, indent=1)[:-2] + ',\n "cells": [\n' + cells + "\n ]\n}\n")
    return path


def pick(names: str | None) -> list[Cell]:
    cells = grid()
    if not names:
        return cells
    wanted = set(names.split(","))
    chosen = [c for c in cells if c.name in wanted or (c is W3_LITE and "w3-lite" in wanted)]
    missing = wanted - {c.name for c in chosen} - ({"w3-lite"} if W3_LITE in chosen else set())
    if missing:
        raise SystemExit(f"w3_grid: no cell named {', '.join(sorted(missing))}")
    return chosen


def per_seed(rows: list[dict]) -> dict[str, list[int]]:
    """Per policy (ours, the previous default), cells meeting both targets in each request stream."""
    counts: dict[str, list[int]] = {}
    for row in rows:
        for policy, oks in row.get("seed_both_ok", {}).items():
            totals = counts.setdefault(policy, [0] * len(oks))
            for s, ok in enumerate(oks):
                totals[s] += ok
    return counts


def router_added_summary(rows: list[dict], ours: str) -> dict[str, float]:
    """The highest p99 over the cells (and their streams) of ours's own time per request (the real
    mode's ``router_added_ms_p99``); empty where no cell has it (the simulated grid)."""
    figures = [r["policies"].get(ours, {}) for r in rows]
    added = [f.get("router_added_ms_p99_max", f["router_added_ms_p99"]) for f in figures if "router_added_ms_p99" in f]
    return {"router_added_ms_p99_max": max(added)} if added else {}


def paired_ok(v: dict, tolerance: float = 0.05) -> bool:
    """Both targets met on the paired ratios (bench.w3_grid_cells.paired), where the cell has them."""
    return (v.get("hit_paired_vs_best", 0.0) >= 1 - tolerance
            and v.get("p90_paired_vs_best", float("inf")) <= 1 + tolerance)


def updated_rows(path: Path, rows: list[dict], run: dict[str, str]) -> list[dict]:
    """``--update``: the rows of the grid's JSON at ``path``, each cell run now (``rows``) in place of
    its row there, new ones after; every row records the commit and command it ran with (``run``:
    this run's), so a cell rerun alone is still one run of all its routers."""
    old = json.loads(path.read_text())
    fresh = {row["cell"]["name"]: {**row, "run": run} for row in rows}
    kept = [fresh.pop(row["cell"]["name"], None) or {**row, "run": row.get("run") or {
        "commit": old["commit"], "command": old["command"]}} for row in old["cells"]]
    return kept + list(fresh.values())


BEFORE = "predicted-ttft@before"  # the default policy of the --before-checkout commit


def start_before_side(checkout: Path, cells: str | None, seeds: int, max_num_seqs: int) -> Callable[[], dict[str, dict]]:
    """Starts the other commit's side: its own bench.w3_grid in a child process importing from that
    tree, on the same cells and request streams, beside this side's cells (a core each); the
    returned call waits for it and gives each cell's default-policy figures."""
    out = Path(checkout) / "w3_grid_before.json"
    argv = [sys.executable, "-m", "bench.w3_grid", "--seeds", str(seeds), "--out", str(out),
            "--max-num-seqs", str(max_num_seqs), *(["--cells", cells] if cells else [])]
    child = subprocess.Popen(argv, cwd=checkout, env=checkout_env(checkout), stdout=subprocess.DEVNULL)

    def result() -> dict[str, dict]:
        if child.wait() != 0:
            raise SystemExit(f"w3_grid: the --before-checkout side failed (exit {child.returncode})")
        rows = json.loads(out.read_text())["cells"]
        out.unlink()
        return {row["cell"]["name"]: row["policies"][OURS["sim"]] for row in rows}

    return result


def simulated_rows(cells: list[Cell], policies: tuple[str, ...], seeds: int, max_num_seqs: int | None,
                   jobs: int) -> Iterator[dict]:
    """Each cell's simulated row, in the cells' order, over ``jobs`` processes (a cell's streams
    are deterministic, so the processes change no figure, only the wall time)."""
    if jobs <= 1:
        for cell in cells:
            yield simulate_cell(cell, policies, seeds, max_num_seqs=max_num_seqs)
        return
    one = partial(simulate_cell, policies=policies, seeds=seeds, max_num_seqs=max_num_seqs)
    with ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(one, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("sim", "real"), default="sim")
    parser.add_argument("--cells", default=None)
    parser.add_argument("--seeds", type=int, default=3, help="sim: request streams per cell (medians)")
    parser.add_argument("--seed", type=int, default=0, help="real: the first request stream")
    parser.add_argument("--streams", type=int, default=1,
                        help="real: request streams per cell (seeds --seed on), the routers' order rotated each; "
                             "medians and each stream's verdict")
    parser.add_argument("--routers", default="vllm-router:cache_aware,kvscale:predicted-ttft,kvscale:round-robin",
                        help="real: routers in the order run ('kvscale@DIR:policy' runs another checkout's)")
    parser.add_argument("--threads", type=int, default=1, help="real: torch threads a replica ('fast' cells: 2)")
    parser.add_argument("--replica-nice", type=int, default=10)
    parser.add_argument("--router-nice", type=int, default=-5)
    parser.add_argument("--previous", default=None,
                        help="sim: also run this policy in every cell (e.g. predicted-ttft/rawqueue, the default "
                             "before its last change) and summarise its verdicts beside the default's")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="sim: each replica's batch slots (default: the cell's concurrency, so a batch fills "
                             "only when every request is on one replica)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="sim: cells simulated at once, a process each (the figures do not depend on it)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--update", action="store_true",
                        help="replace only these cells' rows in the JSON (--out, else the mode's in bench/results), "
                             "the others kept with the commit and command they ran with; the summary over all")
    add_before_checkout(parser, help="sim: also the default policy of this tree (a git worktree of an earlier "
                                     "commit) on the same cells and streams, summarised as the previous default")
    args = parser.parse_args(argv)
    if args.before_checkout is not None:
        if args.mode != "sim" or args.previous:
            parser.error("--before-checkout: the simulated grid only, instead of --previous")
        args.previous = BEFORE
    from bench.roofline import cpu_info

    started = time.time()
    machine = cpu_info()  # before the run: its load average is the start's
    rows = []
    tokenizer = None
    if args.mode == "real":
        from bench.w3_grid_real import vllm_router_binary
        from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

        if "vllm-router:" in args.routers and vllm_router_binary() is None:
            print("w3_grid: vllm-router not installed: pip install -e '.[bench-routing]'", file=sys.stderr)
            return 2

        tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    before_result = (start_before_side(args.before_checkout, args.cells, args.seeds, args.max_num_seqs)
                     if args.before_checkout is not None else None)
    cells = pick(args.cells)
    if args.mode == "sim":
        policies = POLICIES + ((args.previous,) if args.previous and before_result is None else ())
        computed: Iterator[dict] = simulated_rows(cells, policies, args.seeds, args.max_num_seqs or None, args.jobs)
    else:
        from bench.w3_grid_real import run_cell

        computed = (run_cell(cell, args, tokenizer) for cell in cells)
    for cell, row in zip(cells, computed, strict=True):
        rows.append(row)
        if args.mode == "sim":
            figures = "  ".join(f"{p} hit {x['hit_rate']:.3f} p90 {x['ttft_p90_s']:.1f}"
                                for p, x in row["policies"].items())
            print(f"sim {cell.name:36} {figures}", flush=True)
    before = before_result() if before_result is not None else {}
    for row in rows:
        if row["cell"]["name"] in before:
            row["policies"][BEFORE] = before[row["cell"]["name"]]
        if all(p in row["policies"] for p in (OURS[args.mode], *BASELINES[args.mode])):
            row["verdict"] = verdict(row, OURS[args.mode], BASELINES[args.mode])
            if args.previous and args.previous in row["policies"]:
                row["previous_verdict"] = verdict(row, args.previous, BASELINES[args.mode])
            if "per_seed" in row["policies"][OURS[args.mode]]:  # each stream's own verdict, ours and the previous
                row["seed_both_ok"] = {p: seed_verdicts(row, p, BASELINES[args.mode])
                                       for p in (OURS[args.mode], args.previous) if p in row["policies"]}
    command = " ".join([os.path.basename(sys.executable), "-m", "bench.w3_grid", *(argv or sys.argv[1:])])
    if args.update:
        rows = updated_rows(Path(args.out) if args.out else RESULTS / f"w3_grid_{args.mode}.json", rows,
                            {"commit": git_commit(REPO), "command": command})
    verdicts = [r["verdict"] for r in rows if "verdict" in r]
    previous = [r["previous_verdict"] for r in rows if "previous_verdict" in r]
    path = write_compact(f"w3_grid_{args.mode}", {
        "benchmark": "w3_grid", "mode": args.mode,
        "command": command,
        "machine": machine, "commit": git_commit(REPO),
        **({"before_commit": git_commit(args.before_checkout)} if args.before_checkout is not None else {}),
        "elapsed_s": round(time.time() - started, 1), "cells": rows,
        "summary": {"cells": len(rows), "hit_within_5pct": sum(v["hit_ok"] for v in verdicts),
                    "p90_within_5pct": sum(v["p90_ok"] for v in verdicts),
                    "both_within_5pct": sum(v["hit_ok"] and v["p90_ok"] for v in verdicts),
                    **({"both_within_5pct_paired": sum(paired_ok(v) for v in verdicts)}
                       if any("p90_paired_vs_best" in v for v in verdicts) else {}),
                    **({"previous_default": {
                        "policy": args.previous, "hit_within_5pct": sum(v["hit_ok"] for v in previous),
                        "p90_within_5pct": sum(v["p90_ok"] for v in previous),
                        "both_within_5pct": sum(v["hit_ok"] and v["p90_ok"] for v in previous)}} if previous else {}),
                    **({"both_within_5pct_per_seed": per_seed(rows)} if any("seed_both_ok" in r for r in rows) else {}),
                    **router_added_summary(rows, OURS[args.mode])},
    }, args.out)
    print(f"w3_grid: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
