"""W3 / W3-Zipf / W4's report per (workload, policy): hit rate and its share of the ceiling,
TTFT, throughput, balance, the router's added latency; the ratios against the other policies,
and the figure (bench.w3_router)."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.stats import quantile


def summarize(args, workload: str, policy: str, results: list[dict], wall: float, q: tuple, h: tuple) -> dict:
    ok = [r for r in results if r["ok"]]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    counts = [per_replica.get(f"replica-{i}", 0) for i in range(args.replicas)]
    mean = statistics.mean(counts)
    ttfts = [r["ttft_s"] for r in ok]
    router_ms = [r["router_ms"] for r in ok]
    (q0, q1), (h0, h1) = q, h
    return {
        "workload": workload,
        "policy": policy,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "prefix_cache_queries_tokens": q1 - q0,
        "prefix_cache_hits_tokens": h1 - h0,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "latency_p50_s": quantile([r["latency_s"] for r in ok], 0.5),
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / wall,
        "wall_s": wall,
        "requests_per_replica": counts,
        "max_over_mean_requests": max(counts) / mean if mean else float("nan"),
        "router_added_ms_p50": quantile(router_ms, 0.5),
        "router_added_ms_p99": quantile(router_ms, 0.99),
        "predicted_hit_tokens_total": sum(r["predicted_hit_tokens"] for r in ok),
        "per_request": [
            {k: r.get(k) for k in ("ttft_s", "replica", "router_ms", "predicted_hit_tokens", "turn", "output_tokens")}
            for r in ok
        ],
    }


def run_ceiling(args, results: list[dict], tokenizer) -> float:
    """The workload's ceiling on the token ids this run sent, in the order it sent them (the best
    hit rate any routing could reach with the fleet's KV: ``bench.w3_ceilings.capacity_ceiling``).
    W4's prompts hold the answers the replicas gave, so each policy's run has its own; an answer
    counts as the token ids its text encodes to."""
    from bench.w3_ceilings import capacity_ceiling
    from bench.w3_workloads import Workload
    from kvscale.tokenization import chat_prompt_token_ids

    requests = []
    for r in sorted((r for r in results if r["ok"]), key=lambda r: r["sent_at"]):
        if "messages" in r:
            prompt = chat_prompt_token_ids(tokenizer, r["messages"])
            answer = tokenizer.encode(r.get("text", ""), add_special_tokens=False)
        else:
            prompt, answer = r["prompt_ids"], []
        requests.append((0.0, prompt, answer, r["output_tokens"]))
    return capacity_ceiling(Workload([requests]), args.block_size, args.replicas * args.num_gpu_blocks_override)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.4 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        rows = [r for r in results if r["workload"] == workload]
        names = [r["policy"] for r in rows]
        colors = ["tab:green" if n == "predicted-ttft" else "tab:gray" for n in names]
        left, right = axes[row]
        left.bar(names, [100 * r["prefix_cache_hit_rate"] for r in rows], color=colors)
        left.set_ylabel("prefix-cache hit rate (%)")
        left.set_title(f"{workload}: replicas' own hit rate")
        left.tick_params(axis="x", labelrotation=15)
        x = range(len(names))
        right.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in rows], width=0.4, label="p50")
        right.bar([i + 0.2 for i in x], [r["ttft_p90_s"] for r in rows], width=0.4, label="p90")
        right.set_xticks(list(x), names, rotation=15)
        right.set_ylabel("TTFT (s)")
        right.set_title(f"{workload}: time to first token")
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ratios(results: list[dict], policy: str = "predicted-ttft") -> dict:
    """Per workload: the policy against round-robin (the issue's targets) and against every other."""
    out: dict[str, dict] = {}
    for workload in dict.fromkeys(r["workload"] for r in results):
        by = {r["policy"]: r for r in results if r["workload"] == workload}
        me = by.get(policy)
        if me is None:
            continue
        entry: dict = {"max_over_mean_requests": me["max_over_mean_requests"],
                       "router_added_ms_p99": me["router_added_ms_p99"],
                       "share_of_ceiling": me.get("share_of_ceiling")}
        for other, r in by.items():
            if other == policy:
                continue
            entry[f"vs_{other}"] = {
                "hit_rate": me["prefix_cache_hit_rate"] / r["prefix_cache_hit_rate"] if r["prefix_cache_hit_rate"]
                else float("inf"),
                "ttft_p50_better": r["ttft_p50_s"] / me["ttft_p50_s"],
                "ttft_p90_better": r["ttft_p90_s"] / me["ttft_p90_s"],
                "throughput": me["output_tokens_per_s"] / r["output_tokens_per_s"],
            }
        out[workload] = entry
    return out
