"""W3, W3-Zipf and W4 behind the router: every routing policy on the same request streams, one run.

N replicas of the bundled model with small KV pools (so eviction matters), one Redis, and one
router per policy (all started up front). For each workload, each policy replays the same request
stream (same seed) with its own ``cache_salt``, so no policy inherits another's cache while all see
identical prompts. Policies run one after the other, in an order rotated per workload; a shared
machine's speed drifts meanwhile, so each run also records the rates its replicas measured, and
the simulator replays every run at its own rates. (``--blocks N`` interleaves policies in N
slices instead, valid only with pools large enough to keep every policy's cache.) Per (workload,
policy): the replicas' own prefix-cache hit rate and its share of the ceiling (the best hit rate any
routing could reach with the fleet's KV, on the token ids that run sent), TTFT p50/p90,
output throughput, max/mean requests per replica, router-added latency p50/p99 (the router's own
time from a request's last byte to sending it upstream, reported per response), and the replicas'
measured rates from their heartbeats (prefill tokens/s, decode step time), which calibrate the
simulator (bench.w3_policy_sim).

    python -m bench.w3_router                          # the recorded run (about 10 minutes here)
    python -m bench.w3_router --workloads w3 --requests 32 ...   # smaller; the JSON records parameters
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.stats import quantile
from bench.w3_workloads import (
    WORKLOADS,
    conversation_messages,
    conversations,
    shared_prefix_prompts,
)
from kvscale.processes import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
# "NAME@EPS" runs policy NAME with --balance-epsilon EPS (the router's default is 0.25).
POLICIES = ("predicted-ttft", "prefix-affinity", "weighted", "round-robin")


def _child_setup(nice: int) -> None:
    die_with_parent()  # a killed benchmark leaves no replicas behind
    if nice:
        os.nice(nice)


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="kvscale-w3-")

    def start(self, name: str, argv: list[str], nice: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
            preexec_fn=lambda: _child_setup(nice),
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited with {proc.returncode} during startup")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy: {pending}")
        time.sleep(0.5)


def cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in replica_urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for line in text.splitlines():
            match = re.match(r"^(vllm:prefix_cache_(?:queries|hits)_total)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
            if match:
                if match.group(1).endswith("queries_total"):
                    queries += float(match.group(3))
                else:
                    hits += float(match.group(3))
    return queries, hits


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    started = time.perf_counter()
    first = None
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:
                continue  # a usage-only chunk
            choice = choices[0]
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            # A chat stream opens with a role-only chunk sent before any prefill: not a first token.
            if first is None and ("text" in choice or piece or choice.get("finish_reason")):
                first = time.perf_counter()
            if piece:
                text.append(piece)
                tokens += 1
        return {
            "ok": True,
            "ttft_s": (first or time.perf_counter()) - started,
            "latency_s": time.perf_counter() - started,
            "replica": response.headers.get("x-kvscale-replica"),
            "router_ms": float(response.headers.get("x-kvscale-router-ms", "nan")),
            "predicted_hit_tokens": int(response.headers.get("x-kvscale-predicted-hit-tokens", "0")),
            "text": "".join(text),
            "chunks": tokens,
        }


async def drive_prompts(router_url: str, prompts: list[list[int]], args, salt: str) -> tuple[list[dict], float]:
    """W3 / W3-Zipf: a closed loop of ``concurrency`` clients over token-id prompts."""
    concurrency = min(args.concurrency, len(prompts))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "cache_salt": salt}
                sent = time.perf_counter()
                result = await _stream(client, f"{router_url}/v1/completions", body)
                result["output_tokens"] = args.output_tokens
                result["sent_at"], result["prompt_ids"] = sent, prompt
                results.append(result)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


async def drive_chats(router_url: str, convs, args, salt: str) -> tuple[list[dict], float]:
    """W4: ``concurrency`` conversations at a time; each turn's prompt is the history plus a new message."""
    concurrency = min(args.concurrency, len(convs))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for conv in convs:
            queue.put_nowait(conv)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                answers: list[str] = []
                for turn in range(len(conv.questions)):
                    await asyncio.sleep(conv.think_s[turn])
                    body = {"model": MODEL, "messages": conversation_messages(conv, turn, answers),
                            "max_tokens": args.answer_tokens, "temperature": 0, "stream": True, "cache_salt": salt}
                    sent = time.perf_counter()
                    result = await _stream(client, f"{router_url}/v1/chat/completions", body)
                    result["turn"] = turn
                    result["sent_at"], result["messages"] = sent, body["messages"]
                    result["output_tokens"] = result.get("chunks", 0)
                    results.append(result)
                    if not result["ok"]:
                        break
                    answers.append(result["text"])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


class HeartbeatSampler:
    """Reads every replica's heartbeat from Redis twice a second, for the simulator's calibration."""

    FIELDS = ("prefill_tokens_per_s", "decode_step_s", "step_token_budget", "num_decoding",
              "prefill_tokens_waiting")

    def __init__(self, redis_url: str) -> None:
        import redis

        from kvscale.kv_index_schema import heartbeat_key

        self._client = redis.Redis.from_url(redis_url)
        self._key = heartbeat_key
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i in range(64):
                raw = self._client.get(self._key(f"replica-{i}"))
                if raw is None:
                    if i >= 8:
                        break
                    continue
                beat = json.loads(raw)
                self.samples.append({"t": time.time(), "replica": beat["replica"],
                                     **{k: beat.get(k, 0) for k in self.FIELDS}})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, windows: list[tuple[float, float]]) -> dict:
        window = [s for s in self.samples if any(a <= s["t"] <= b for a, b in windows)]
        out = {}
        for key in ("prefill_tokens_per_s", "decode_step_s", "step_token_budget"):
            values = [s[key] for s in window if s[key] > 0]
            out[f"{key}_median"] = statistics.median(values) if values else 0.0
        return out


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


def workload_items(args, workload: str) -> list:
    """The run's whole stream: token-id prompts (W3, W3-Zipf) or conversations (W4)."""
    if workload == "w4":
        return conversations(args.seed, args.conversations, args.document_words, args.question_words,
                             (args.think_min_s, args.think_max_s))
    return [p for _, p in shared_prefix_prompts(args.seed, args.groups, args.prefix_tokens, args.requests,
                                                args.suffix_tokens, zipf=workload == "w3-zipf")]


def run_block(args, workload: str, policy: str, router_url: str, replica_urls: list[str], items: list) -> dict:
    """One slice of the stream through one policy's router; the policy's own cache_salt."""
    salt = f"{workload}-{policy}-{args.seed}"
    q0, h0 = cache_counters(replica_urls)
    since = time.time()
    load = os.getloadavg()[0]
    drive = drive_chats if workload == "w4" else drive_prompts
    results, wall = asyncio.run(drive(router_url, items, args, salt))
    q1, h1 = cache_counters(replica_urls)
    return {"results": results, "wall": wall, "queries": q1 - q0, "hits": h1 - h0, "window": (since, time.time()),
            "loadavg": (load, os.getloadavg()[0])}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=128)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="requests per W3 / W3-Zipf run")
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8, help="W4 conversations per run (3-6 turns each)")
    parser.add_argument("--document-words", type=int, default=60, help="W4: turn 1's document, in words")
    parser.add_argument("--question-words", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=8, help="W4: max tokens per answer")
    parser.add_argument("--think-min-s", type=float, default=0.2)
    parser.add_argument("--think-max-s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--blocks", type=int, default=1,
        help="slices of each stream, each run through every policy in turn (spreads machine drift). Only "
        "meaningful when the KV pools hold every policy's working set: otherwise each policy's next slice "
        "finds its cache evicted by the others' (a 4-block run at the defaults halved every hit rate)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=48, help="KV blocks per replica")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the replicas' token budget per step (default: the engine's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per replica (OMP_NUM_THREADS): four replicas share the cores")
    parser.add_argument(
        "--replica-nice", type=int, default=10,
        help="CPU niceness of the replicas. In a cluster the router has CPUs of its own and the replicas "
        "compute on GPUs; here four CPU-bound replicas share the router's cores, and without this the "
        "router's latency measures the kernel's time slices, not the router (0 to measure that anyway).",
    )
    parser.add_argument(
        "--router-nice", type=int, default=-5,
        help="CPU niceness of the routers: they stand in for router pods with CPUs of their own; on a shared "
        "machine other users' processes would otherwise preempt them mid-decision (0 to measure that anyway)",
    )
    parser.add_argument("--router-redis-timeout-ms", type=float, default=250.0,
                        help="the routers' --redis-timeout-ms (50 by default) on this overloaded machine")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "w3_router_ttft.json"))
    args = parser.parse_args()

    redis_binary = shutil.which("redis-server")
    if not redis_binary:
        print("w3_router: needs redis-server on the PATH (make system-deps)", file=sys.stderr)
        return 2
    from bench.roofline import cpu_info
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    procs = Processes()
    started = time.time()
    host = cpu_info()
    policies = args.policies.split(",")
    results: list[dict] = []
    sampler = None
    try:
        redis_port = free_port()
        procs.start("redis", [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", procs.logdir])
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        replica_urls, replica_procs = [], []
        for i in range(args.replicas):
            port = free_port()
            replica_urls.append(f"http://127.0.0.1:{port}")
            replica_procs.append(procs.start(
                f"replica-{i}",
                [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.num_gpu_blocks_override),
                 "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
                 "--redis", redis_url, "--replica-id", f"replica-{i}", "--disable-uvicorn-access-log"]
                + ([] if args.max_num_batched_tokens is None
                   else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]),
                nice=args.replica_nice, env={"OMP_NUM_THREADS": str(args.threads)},
            ))
        routers: dict[str, str] = {}
        router_procs = []
        for policy in policies:
            port = free_port()
            name, _, epsilon = policy.partition("@")
            routers[policy] = f"http://127.0.0.1:{port}"
            router_procs.append(procs.start(
                f"router-{policy}",
                [sys.executable, "-m", "kvscale", "router", "--host", "127.0.0.1", "--port", str(port),
                 "--replicas", ",".join(replica_urls), "--redis", redis_url, "--policy", name,
                 "--block-size", str(args.block_size), "--seed", str(args.seed), "--log-level", "warning",
                 "--redis-timeout-ms", str(args.router_redis_timeout_ms)]
                + (["--balance-epsilon", epsilon] if epsilon else []),
                nice=args.router_nice,
            ))
        print(f"w3_router: starting {args.replicas} replicas and {len(policies)} routers (logs in {procs.logdir})",
              flush=True)
        wait_healthy(replica_urls, replica_procs)
        wait_healthy(list(routers.values()), router_procs, timeout=300)
        time.sleep(2.0)  # heartbeats bind replica ids to URLs in every router
        sampler = HeartbeatSampler(redis_url)
        sampler.start()
        for w, workload in enumerate(args.workloads.split(",")):
            items = workload_items(args, workload)
            # The stream in blocks, each block through every policy in a rotating order: the machine's
            # speed drifts (it is shared), and this spreads the drift over all policies alike.
            size = -(-len(items) // args.blocks)
            blocks = [items[i:i + size] for i in range(0, len(items), size)]
            done: dict[str, list[dict]] = {policy: [] for policy in policies}
            for b, block in enumerate(blocks):
                # Rotated per workload and block so that no policy always runs first.
                k = (w + b) % len(policies)
                for policy in policies[k:] + policies[:k]:
                    done[policy].append(run_block(args, workload, policy, routers[policy], replica_urls, block))
            for policy in policies:
                parts = done[policy]
                sent = [r for part in parts for r in part["results"]]
                record = summarize(args, workload, policy, sent,
                                   sum(part["wall"] for part in parts),
                                   (0.0, sum(part["queries"] for part in parts)),
                                   (0.0, sum(part["hits"] for part in parts)))
                record["ceiling"] = run_ceiling(args, sent, tokenizer)
                record["share_of_ceiling"] = (record["prefix_cache_hit_rate"] / record["ceiling"]
                                              if record["ceiling"] else float("nan"))
                record["replica_rates"] = sampler.summary([part["window"] for part in parts])
                record["loadavg_1m_before"] = round(parts[0]["loadavg"][0], 2)
                record["loadavg_1m_after"] = round(parts[-1]["loadavg"][1], 2)
                print(json.dumps({k: v for k, v in record.items() if k != "per_request"}), flush=True)
                results.append(record)
    finally:
        if sampler is not None:
            sampler.stop()
        procs.stop_all()

    summary = ratios(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "w3_router",
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "machine": host,
        "parameters": vars(args),
        "results": results,
        "summary": summary,
        "elapsed_s": time.time() - started,
    }
    out.write_text(json.dumps(record, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    print(f"w3_router: wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
