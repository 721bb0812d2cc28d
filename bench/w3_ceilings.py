"""``bench.w3_policy_sim --mode ceiling``: each policy's hit rate as a fraction of the workload's
ceiling, the best hit rate any assignment of requests to replicas could reach with the same KV
capacities (Belady's MIN over one pool of the fleet's combined size; the module docstring of
bench.w3_policy_sim says why that bounds every fleet); and the arithmetic ceiling, where every
group's first request misses."""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from pathlib import Path

from bench.common import write_result
from bench.roofline import cpu_info
from bench.w3_sim import Costs
from bench.w3_sim_run import calibration, over_seeds
from bench.w3_workloads import Workload, build_workload


def hit_ceiling(workload: Workload, block_size: int) -> float:
    """The best hit rate any routing allows: one replica with an unbounded cache. A request can
    reuse only the blocks requests before it computed (prompts and answers), at most all but its
    last token (the engine computes that one), so every group's first request misses."""
    from kvscale.block_hash import hash_prompt_blocks

    seen: set[int] = set()
    hit = total = 0
    for client in workload.clients:  # each client's requests in order; clients share prefixes alike
        for _, prompt, answer, _ in client:
            hashes = hash_prompt_blocks(prompt, block_size)
            n = 0
            for h in hashes[: (len(prompt) - 1) // block_size]:
                if h not in seen:
                    break
                n += 1
            hit += n * block_size
            total += len(prompt)
            seen.update(hashes)
            seen.update(hash_prompt_blocks(prompt + answer, block_size))
    return hit / total


def arrival_order(workload: Workload) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) in about the order a closed loop sends them: every client's n-th request
    before any client's (n+1)-th (for W3 exactly the generated stream's order)."""
    out = []
    longest = max((len(c) for c in workload.clients), default=0)
    for n in range(longest):
        for client in workload.clients:
            if n < len(client):
                _, prompt, answer, _ = client[n]
                out.append((prompt, answer))
    return out


def capacity_ceiling(workload: Workload, block_size: int, total_blocks: int) -> float:
    """The best hit rate any routing could reach with ``total_blocks`` of KV in all: Belady's MIN
    (evict the block needed furthest in the future; among equals the one furthest into its prompt,
    so prefixes stay whole) over one pool of the fleet's size. Hits as the engine counts them."""
    from kvscale.block_hash import hash_prompt_blocks

    requests = arrival_order(workload)
    looked: list[list[int]] = []  # blocks each request may hit, in order
    stored: list[list[int]] = []  # blocks it leaves computed (prompt, then prompt + answer)
    for prompt, answer in requests:
        hashes = hash_prompt_blocks(prompt, block_size)
        looked.append(hashes[: (len(prompt) - 1) // block_size])
        stored.append(list(dict.fromkeys(hashes + hash_prompt_blocks(prompt + answer, block_size))))
    uses: dict[int, deque[int]] = {}
    for j, blocks in enumerate(looked):
        for h in blocks:
            uses.setdefault(h, deque()).append(j)
    never = len(requests)
    cache: dict[int, int] = {}  # block -> its position in the prompt that stored it
    hit = total = 0
    for j, (prompt, _) in enumerate(requests):
        n = 0
        for h in looked[j]:
            if h not in cache:
                break
            n += 1
        hit += n * block_size
        total += len(prompt)
        for h in looked[j]:
            queue = uses[h]
            while queue and queue[0] <= j:
                queue.popleft()
        for position, h in enumerate(stored[j]):
            cache[h] = position
        while len(cache) > total_blocks:
            victim = max(cache, key=lambda b: (uses[b][0] if uses.get(b) else never, cache[b]))
            del cache[victim]
    return hit / total if total else 0.0


def ceiling_cases(params: dict, w4_params: dict, costs: Costs) -> list[tuple[str, str, dict, dict]]:
    """(case, workload kind, stream parameters, fleet) for --mode ceiling."""
    real = dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                block_size=params["block_size"], costs=costs)
    full = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                concurrency=16)
    issue = dict(params, groups=12, prefix_tokens=512, suffix_tokens=16, requests=144, output_tokens=4,
                 concurrency=8)
    eight = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 8)
    sixteen = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)
    half = Costs(costs.prefill_tokens_per_s / 2, costs.decode_step_s * 2, costs.step_tokens, 8)
    return [
        ("W3, real-run setup", "w3", params, real),
        ("W3-Zipf, real-run setup", "w3-zipf", params, real),
        ("W4, real-run setup", "w4", w4_params, real),
        ("full W3 (16 x 512, 4 x 192 blocks)", "w3", full,
         dict(replicas=4, num_blocks=192, block_size=params["block_size"], costs=sixteen)),
        ("fits (12 x 512, 3 x 160 blocks)", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=eight)),
        ("does not fit (12 x 512, 3 x 96 blocks)", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=eight)),
        ("does not fit, Zipf (12 x 512, 3 x 96 blocks)", "w3-zipf", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=eight)),
        # One replica at half the others' speed, as its heartbeat says (replicas time their own
        # steps); then one whose heartbeat reports the others' speed (a neighbour arrived since:
        # what the TTFT calibration is for, since the raw estimate cannot see it).
        ("fits, one replica at half speed", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=[half, eight, eight])),
        ("does not fit, one replica at half speed", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=[half, eight, eight])),
        ("fits, one replica at half its reported speed", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=[half, eight, eight],
              reported=[eight] * 3)),
        ("does not fit, one replica at half its reported speed", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=[half, eight, eight],
              reported=[eight] * 3)),
    ]


def ceiling_mode(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    policies = args.policies.split(",")
    streams: dict = {}
    cases = []
    for case, kind, p, fleet in ceiling_cases(params, w4_params, costs):
        ceilings = []
        for s in range(args.seeds):
            key = (kind, s, json.dumps(p, sort_keys=True, default=str))
            if key not in streams:
                streams[key] = build_workload(kind, p, p["seed"] + s, tokenizer, answer_tokens)
            ceilings.append(capacity_ceiling(streams[key], fleet["block_size"], fleet["replicas"] * fleet["num_blocks"]))
        ceiling = statistics.median(ceilings)
        rows = {}
        for policy in policies:
            row = over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams, **fleet)
            row["share_of_ceiling"] = row["hit_rate"] / ceiling if ceiling else float("nan")
            rows[policy] = row
        rr = rows.get("round-robin")
        if rr is not None:
            for row in rows.values():
                row["ttft_p90_over_round_robin"] = row["ttft_p90_s"] / rr["ttft_p90_s"]
        cases.append({"case": case, "workload": kind, "fleet": {k: v for k, v in fleet.items() if k not in ("costs", "reported")},
                      "ceiling": ceiling, "policies": rows})
        print(f"{case:46} ceiling {ceiling:.3f}", flush=True)
        for policy, row in rows.items():
            print(f"    {policy:16} hit {row['hit_rate']:.3f} ({row['share_of_ceiling']:.2f} of ceiling)  "
                  f"p50 {row['ttft_p50_s']:.2f}  p90 {row['ttft_p90_s']:.2f}  max/mean "
                  f"{row['max_over_mean_requests']:.2f}", flush=True)
    path = write_result("w3_policy_sim_ceiling", {
        "benchmark": "w3_policy_sim", "mode": "ceiling", "date": time.strftime("%Y-%m-%d"), "machine": cpu_info(),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "cases": cases,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0
