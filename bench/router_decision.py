"""What one routing decision costs in the router process, and what a full GC costs there.

The router's own code on W3-shaped prompts (a 528-token prompt as token ids, 4 replicas),
in process, no network: the median time of each step of a decision (JSON parse, token ids,
block hashes, index lookup and scoring). Then a full garbage collection in that same process
(tokenizer loaded, so transformers and torch imported) before and after
``freeze_startup_heap``, the baseline and the change measured in one run.

    python -m bench.router_decision      # writes bench/results/router_decision.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

from bench.common import machine, write_result
from kvscale.processes import freeze_startup_heap
from kvscale.router.app import Router, RouterConfig


def median_ms(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=528)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--gc-repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    router = Router(RouterConfig(replicas=[f"http://127.0.0.1:{9000 + i}" for i in range(args.replicas)], seed=0))
    router._load_tokenizers()  # what Router.start does before serving
    replicas = list(router.replicas.replicas.values())
    for replica in replicas:
        replica.healthy = True
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    raw = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 32}).encode()
    body = json.loads(raw)
    hashes, _, _ = router.prompt_block_hashes("completions", body, body["model"])
    # Half the replicas hold the prompt's prefix, as after a few requests of its group.
    for replica in replicas[: args.replicas // 2]:
        router.index.stored(replica.replica_id, hashes[: len(hashes) // 2])

    steps_ms = {
        "json_parse": median_ms(lambda: json.loads(raw), args.repeats),
        "tokenize_and_hash": median_ms(lambda: router.prompt_block_hashes("completions", body, body["model"]),
                                       args.repeats),
        "lookup_and_score": median_ms(lambda: router.decide(replicas, hashes, hashes[0], None), args.repeats),
    }
    steps_ms["decision_total"] = sum(steps_ms.values())

    tracked_before = len(gc.get_objects())
    full_gc_before_ms = median_ms(gc.collect, args.gc_repeats)
    freeze_startup_heap()
    tracked_after = len(gc.get_objects())
    full_gc_after_ms = median_ms(gc.collect, args.gc_repeats)

    result = {
        "benchmark": "router_decision",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "parameters": vars(args),
        "decision_median_ms": steps_ms,
        "full_gc": {
            "tracked_objects_before_freeze": tracked_before,
            "tracked_objects_after_freeze": tracked_after,
            "median_ms_before_freeze": full_gc_before_ms,
            "median_ms_after_freeze": full_gc_after_ms,
            "speedup": full_gc_before_ms / full_gc_after_ms if full_gc_after_ms else float("inf"),
        },
    }
    path = write_result("router_decision", result, args.out)
    print(json.dumps({"decision_median_ms": steps_ms, "full_gc": result["full_gc"]}, indent=2))
    print(f"router_decision: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
