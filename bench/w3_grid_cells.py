"""The routing grid's cells (bench.w3_grid): what the earlier router runs held fixed, varied one
cell at a time, and a cell run on the simulated fleet (bench.w3_sim).

A cell is a shared-prefix workload (12 groups, 144 requests, 32-token unique suffixes, 8 output
tokens) on three replicas, with:
- ``concurrency``: requests in flight (4, 8, 32);
- ``prefix_tokens``: each group's prefix (256 to 4096);
- ``capacity``: "fits" (the groups' prefixes take 80 % of the fleet's KV blocks) or "over" (twice
  the fleet's KV blocks);
- ``speed``: "uniform" (the calibrated replica), "fast" (every replica twice as fast: a thread
  per replica that does not fight for cores), "throttled" (one replica at half speed);
- ``order``: "random" (groups interleaved) or "bursty" (a group's requests in runs of six).
The held-out W3-lite cell is the shape a new user tried: 512-token prefixes, 160 blocks a replica;
it runs a second time behind a 64-token preamble every prompt opens with (``preamble_tokens``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass, replace

from bench.w3_ceilings import hit_ceiling
from bench.w3_sim import Costs
from bench.w3_sim_run import simulate_run
from bench.w3_workloads import Workload, group_order

GROUPS, REQUESTS, SUFFIX_TOKENS, OUTPUT_TOKENS, REPLICAS, BLOCK_SIZE = 12, 144, 32, 8, 3, 16
FITS_SHARE = 0.8  # "fits": the prefixes take this share of the fleet's blocks
OVER_FACTOR = 2.0  # "over": the prefixes take this many times the fleet's blocks
THROTTLE = 0.5  # the throttled replica's speed
# The three routers every cell compares (simulated names; bench.w3_grid_real runs the real ones).
POLICIES = ("predicted-ttft", "round-robin", "vllm-router-cache-aware")
# Calibrated on this machine's fleet: its heartbeats' median rates during a W3-lite run with one
# thread per replica (bench/results/w3_grid_real.json records the run's own).
BASE_COSTS = Costs(prefill_tokens_per_s=42.0, decode_step_s=0.77, step_tokens=2048)


@dataclass(frozen=True)
class Cell:
    concurrency: int = 8
    prefix_tokens: int = 512
    capacity: str = "fits"
    speed: str = "uniform"
    order: str = "random"
    num_blocks: int | None = None  # fixed KV blocks a replica (None: from ``capacity``)
    # Tokens every prompt opens with before its group's prefix (a system prompt all groups share).
    preamble_tokens: int = 0

    @property
    def name(self) -> str:
        blocks = f"-b{self.num_blocks}" if self.num_blocks else ""
        preamble = f"-pre{self.preamble_tokens}" if self.preamble_tokens else ""
        return f"c{self.concurrency}-p{self.prefix_tokens}-{self.capacity}-{self.speed}-{self.order}{blocks}{preamble}"

    def blocks_per_replica(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        prefix_blocks = GROUPS * (self.prefix_tokens // BLOCK_SIZE)
        share = 1 / FITS_SHARE if self.capacity == "fits" else 1 / OVER_FACTOR
        return -(-int(prefix_blocks * share) // REPLICAS)

    def describe(self) -> dict:
        return {**asdict(self), "name": self.name, "blocks_per_replica": self.blocks_per_replica(),
                "groups": GROUPS, "requests": REQUESTS, "suffix_tokens": SUFFIX_TOKENS,
                "output_tokens": OUTPUT_TOKENS, "replicas": REPLICAS}


W3_LITE = Cell(num_blocks=160)  # the held-out shape: 12 x 512-token prefixes, 3 x 160 blocks
# W3-lite behind a 64-token system prompt every group shares: the groups part after four blocks.
W3_LITE_PREAMBLE = replace(W3_LITE, preamble_tokens=64)
PREAMBLE_SEED = 7919  # added to a stream's seed for its preamble (the other draws stay as they were)


def grid(concurrency: tuple[int, ...] = (4, 8, 32), prefix_tokens: tuple[int, ...] = (256, 1024, 4096),
         capacity: tuple[str, ...] = ("fits", "over"), speed: tuple[str, ...] = ("uniform", "fast", "throttled"),
         order: tuple[str, ...] = ("random", "bursty")) -> list[Cell]:
    """W3-lite, alone and behind a shared preamble, then every combination of the axes."""
    combos = itertools.product(concurrency, prefix_tokens, capacity, speed, order)
    return [W3_LITE, W3_LITE_PREAMBLE] + [Cell(*combo) for combo in combos]


def prompts(cell: Cell, seed: int) -> list[tuple[int, list[int]]]:
    """(group, token ids) per request in arrival order (random token ids; the real mode sends text)."""
    import random

    rng = random.Random(seed)
    shared = random.Random(seed + PREAMBLE_SEED)
    preamble = [shared.randrange(1000, 40000) for _ in range(cell.preamble_tokens)]
    prefixes = [[rng.randrange(1000, 40000) for _ in range(cell.prefix_tokens)] for _ in range(GROUPS)]
    order = group_order(rng, GROUPS, REQUESTS, zipf=False, bursty=cell.order == "bursty")
    return [(g, preamble + prefixes[g] + [rng.randrange(1000, 40000) for _ in range(SUFFIX_TOKENS)])
            for g in order]


def workload(cell: Cell, seed: int) -> Workload:
    clients: list[list] = [[] for _ in range(cell.concurrency)]
    for i, (_, prompt) in enumerate(prompts(cell, seed)):
        clients[i % cell.concurrency].append((0.0, prompt, [], OUTPUT_TOKENS))
    return Workload(clients)


def replica_costs(cell: Cell, base: Costs = BASE_COSTS) -> list[Costs]:
    factor = 2.0 if cell.speed == "fast" else 1.0
    out = []
    for i in range(REPLICAS):
        f = factor * (THROTTLE if cell.speed == "throttled" and i == 0 else 1.0)
        out.append(Costs(base.prefill_tokens_per_s * f, base.decode_step_s / f, base.step_tokens, cell.concurrency))
    return out


def simulate_cell(cell: Cell, policies: tuple[str, ...] = POLICIES, seeds: int = 3, base: Costs = BASE_COSTS,
                  max_num_seqs: int | None = None) -> dict:
    """Each policy's hit rate, TTFT p50/p90 and wall time on the simulated fleet: medians over
    ``seeds`` request streams. ``max_num_seqs``: every replica's batch slots (default: the cell's
    concurrency, so no batch fills; fewer, for the cells where one does: docs/router.md,
    "predicted-ttft")."""
    described = cell.describe()
    costs = replica_costs(cell, base)
    if max_num_seqs is not None:
        described["max_num_seqs"] = max_num_seqs
        costs = [replace(c, max_num_seqs=max_num_seqs) for c in costs]
    out: dict = {"cell": described, "policies": {}}
    streams = [workload(cell, s) for s in range(seeds)]
    # The best hit rate any routing allows on these streams (every group's first request misses).
    out["hit_ceiling"] = statistics.median(hit_ceiling(w, BLOCK_SIZE) for w in streams)
    for policy in policies:
        runs = [simulate_run(w, policy, replicas=REPLICAS, num_blocks=cell.blocks_per_replica(),
                             block_size=BLOCK_SIZE, costs=costs, seed=s, heartbeat_queue=True)
                for s, w in enumerate(streams)]
        out["policies"][policy] = {
            "hit_rate": statistics.median(r["hit_rate"] for r in runs),
            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in runs),
            "ttft_p90_s": statistics.median(r["ttft_p90_s"] for r in runs),
            # Beside the target's p90: a router that leaves a few requests waiting very long
            # behind one slow replica, rather than many a little longer, lowers p90 while its
            # tail and wall time grow (docs/performance.md, "The routing grid").
            "ttft_p99_s": statistics.median(r["ttft_p99_s"] for r in runs),
            "ttft_mean_s": statistics.median(r["ttft_mean_s"] for r in runs),
            "wall_s": statistics.median(REQUESTS * OUTPUT_TOKENS / r["output_tokens_per_s"] for r in runs),
            # Each stream's own figures (seed 0, 1, ...): a verdict per stream, beside the medians'.
            "per_seed": [{"hit_rate": r["hit_rate"], "ttft_p90_s": r["ttft_p90_s"]} for r in runs],
        }
    return out


# The figures a verdict compares where lower is better, and the name of ours against the best.
LOWER_IS_BETTER = {"ttft_p90_s": "p90_vs_best", "ttft_p99_s": "p99_vs_best", "ttft_mean_s": "mean_vs_best",
                   "wall_s": "wall_vs_best"}


def verdict(row: dict, ours: str, baselines: tuple[str, ...], tolerance: float = 0.05) -> dict:
    """Ours against the best baseline on hit rate (higher is better) and TTFT p90 (lower): the
    ratios, and whether each is within ``tolerance`` of the best. Beside them, where the figures
    have them, TTFT p99, mean TTFT and wall time against the best baseline's (no target: what a
    p90 won by leaving a few requests waiting very long costs, docs/performance.md, "The routing
    grid")."""
    policies = row["policies"]
    best_hit = max(policies[b]["hit_rate"] for b in baselines)
    hit = policies[ours]["hit_rate"] / best_hit if best_hit else float("inf")
    out: dict = {"hit_vs_best": round(hit, 3)}
    for figure, name in LOWER_IS_BETTER.items():
        if all(figure in policies[p] for p in (ours, *baselines)):
            best = min(policies[b][figure] for b in baselines)
            ratio = policies[ours][figure] / best if best else float("inf")
            out[name] = round(ratio, 3)
    out.update(paired(policies, ours, baselines))
    return {**out, "hit_ok": hit >= 1 - tolerance, "p90_ok": out["p90_vs_best"] <= 1 + tolerance}


def paired(policies: dict, ours: str, baselines: tuple[str, ...]) -> dict:
    """Ours against the best baseline (by the medians) stream by stream: the geometric mean of the
    streams' ratios of hit rate and of TTFT p90. The medians of a p90 that sits on a few levels (a
    cold prefill, plus whole decode steps) move a level at once, 7 % at a 256-token prefix; the
    paired mean weighs every stream (empty where the figures have no streams)."""
    streams = [policies[p].get("per_seed", []) for p in (ours, *baselines)]
    if not streams[0] or any(len(s) != len(streams[0]) for s in streams):
        return {}
    best_hit = max(baselines, key=lambda b: policies[b]["hit_rate"])
    best_p90 = min(baselines, key=lambda b: policies[b]["ttft_p90_s"])

    def mean_ratio(figure: str, best: str) -> float:
        pairs = [(o[figure], b[figure]) for o, b in zip(policies[ours]["per_seed"], policies[best]["per_seed"],
                                                         strict=True)]
        if any(o <= 0 or b <= 0 for o, b in pairs):
            return float("nan")
        return round(math.exp(statistics.mean(math.log(o / b) for o, b in pairs)), 3)

    return {"hit_paired_vs_best": mean_ratio("hit_rate", best_hit),
            "p90_paired_vs_best": mean_ratio("ttft_p90_s", best_p90)}


def seed_verdicts(row: dict, ours: str, baselines: tuple[str, ...], tolerance: float = 0.05) -> list[bool]:
    """Per request stream (seed 0, 1, ...): whether ours met both targets against that stream's
    best baseline (``verdict`` on the stream's own figures)."""
    policies = row["policies"]
    seeds = len(policies[ours].get("per_seed", ()))
    out = []
    for s in range(seeds):
        one = {"policies": {p: policies[p]["per_seed"][s] for p in (ours, *baselines)}}
        v = verdict(one, ours, baselines, tolerance)
        out.append(v["hit_ok"] and v["p90_ok"])
    return out
