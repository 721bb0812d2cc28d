"""What one routing decision costs in the router process, and what a full GC costs there.

In process, no network, the router's own code (``kvscale.router.app.Router``, 4 replicas: its
``hasher`` and ``decider``):

1. A full garbage collection with the tokenizer loaded (so transformers imported) before and after
   ``freeze_startup_heap``, the baseline and the change measured in one run. Everything below then
   runs on the frozen heap, as the router serves after start-up.
2. The median time of each step of a decision on one W3 prompt (528 token ids): JSON parse, token
   ids and block hashes, index lookup and scoring; and on the sixth turn of a W4 conversation of
   each shape below: JSON parse, template render, tokenizing the whole prompt, hashing its blocks,
   the cache's tokenize-and-hash given the fifth turn cached, index lookup and scoring.
3. The decision path per request (what ``x-kvscale-router-ms`` covers: JSON parse, tokenization,
   block hashes, index lookup, the policy) over whole request streams, p50 / p99, with the chat
   token cache (``kvscale.router.chat_tokens``) on and off, side by side: each request goes
   through both routers, in alternating order, so both see the same machine moments.
   - ``w3``: the issue's W3, 16 groups of 512-token prefixes + 16-token suffixes, token ids;
   - ``w4``: the real W4 run's chat shape (8 conversations of 3-6 turns at a time, a 60-word
     document, 6-word questions and answers), every turn the whole history;
   - ``w4-long``: the same with a 1,500-word document and 40-word answers (~2,600-token prompts),
     the shape of a chat about a long document.
   Each W4 pass draws new conversations; decisions are recorded in the index as the router does.

    python -m bench.router_decision      # writes bench/results/router_decision.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from bench import stats
from bench.common import machine, median_ms, write_result
from bench.w3_workloads import WORDS, conversation_messages, conversations, shared_prefix_prompts
from kvscale.block_hash import hash_prompt_blocks
from kvscale.processes import freeze_startup_heap
from kvscale.router.app import Router
from kvscale.router.config import RouterConfig
from kvscale.tokenization import chat_text_token_ids, render_chat_prompt

MODEL = "smollm2-135m-instruct"
W4_SHAPES = {  # workload -> (document words, answer words)
    "w4": (60, 6),
    "w4-long": (1500, 40),
}


def make_router(replicas: int, chat_cache_tokens: int | None = None) -> Router:
    config = RouterConfig(replicas=[f"http://127.0.0.1:{9000 + i}" for i in range(replicas)], seed=0)
    if chat_cache_tokens is not None:
        config.chat_cache_tokens = chat_cache_tokens
    router = Router(config)
    router.hasher.load_tokenizers()  # what Router.start does before serving
    for replica in router.replicas.replicas.values():
        replica.healthy = True
    return router


def decision_ms(router: Router, raw: bytes, endpoint: str) -> tuple[float, int]:
    """The router's time for one request, body received to decision (as in Router.route); then
    the decision is recorded in the index, untimed (the proxy does that after the clock too)."""
    replicas = list(router.replicas.replicas.values())
    started = time.perf_counter()
    body = json.loads(raw)
    hashes, prompt_tokens, block_size = router.hasher.prompt_block_hashes(endpoint, body, body["model"])
    decision = router.decider.decide(replicas, hashes, hashes[0], None, prompt_tokens, block_size)
    elapsed = (time.perf_counter() - started) * 1000
    router.index.predict(decision.ranked[0], hashes, time.monotonic())
    return elapsed, prompt_tokens


def w3_stream(args) -> list[tuple[str, bytes, int]]:
    prompts = shared_prefix_prompts(args.seed, 16, 512, args.requests, 16)
    return [("completions", json.dumps({"model": MODEL, "prompt": p, "max_tokens": 32}).encode(), 0)
            for _, p in prompts]


def w4_stream(args, document_words: int, answer_words: int) -> list[tuple[str, bytes, int]]:
    """(endpoint, body, turn) of passes of 8 conversations, their turns interleaved at random (each
    conversation in order)."""
    stream: list[tuple[str, bytes, int]] = []
    passes = 0
    while len(stream) < args.requests:
        rng = random.Random(args.seed * 1000 + passes)
        convs = conversations(args.seed * 1000 + passes, 8, document_words, 6, (0.2, 1.0))
        answers = [[" ".join(rng.choice(WORDS) for _ in range(answer_words)) + "." for _ in c.questions]
                   for c in convs]
        next_turn = [0] * len(convs)
        active = list(range(len(convs)))
        while active:
            c = rng.choice(active)
            messages = conversation_messages(convs[c], next_turn[c], answers[c])
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "cache_salt": f"pass-{passes}"}
            stream.append(("chat", json.dumps(body).encode(), next_turn[c]))
            next_turn[c] += 1
            if next_turn[c] == len(convs[c].questions):
                active.remove(c)
        passes += 1
    return stream[: args.requests]


def chat_steps(args, router: Router, document_words: int, answer_words: int) -> dict:
    """Step medians on a conversation's sixth turn, the fifth cached (the follow-up case)."""
    rng = random.Random(args.seed)
    conv = conversations(args.seed, 1, document_words, 6, (0.2, 1.0), turns=(6, 6))[0]
    answers = [" ".join(rng.choice(WORDS) for _ in range(answer_words)) + "." for _ in conv.questions]
    previous, messages = (conversation_messages(conv, turn, answers) for turn in (4, 5))
    raw = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "cache_salt": "s"}).encode()
    tokenizer, cache = router.hasher.tokenizers[MODEL], router.hasher.chat_caches[MODEL]
    text = render_chat_prompt(tokenizer, messages)
    ids = chat_text_token_ids(tokenizer, text)
    hashes = hash_prompt_blocks(ids, 16, cache_salt="s")
    replicas = list(router.replicas.replicas.values())

    def follow_up_ms() -> float:
        cache.clear()
        cache.prompt(previous, 16, "s")  # the fifth turn, as the router saw it
        started = time.perf_counter()
        cache.prompt(messages, 16, "s")
        return (time.perf_counter() - started) * 1000

    steps = {
        "prompt_tokens": len(ids),
        "json_parse": median_ms(lambda: json.loads(raw), args.repeats),
        "render_template": median_ms(lambda: render_chat_prompt(tokenizer, messages), args.repeats),
        "tokenize_whole": median_ms(lambda: chat_text_token_ids(tokenizer, text), args.repeats),
        "hash_whole": median_ms(lambda: hash_prompt_blocks(ids, 16, cache_salt="s"), args.repeats),
        "cached_render_tokenize_hash": statistics.median(follow_up_ms() for _ in range(args.repeats)),
        "lookup_and_score": median_ms(
            lambda: router.decider.decide(replicas, hashes, hashes[0], None, len(ids), 16), args.repeats),
    }
    cache.clear()
    return steps


def summary(values: list[float]) -> dict:
    """bench.stats' summary of milliseconds, keys ending in _ms, and the slowest."""
    return {f"{key}_ms": value for key, value in stats.summary(values).items()} | {"max_ms": max(values)}


def side_by_side(stream: list[tuple[str, bytes, int]], routers: dict[str, Router]) -> dict:
    """Each request through every router (order alternating); p50 / p99 over all requests, and
    for chat separately over first turns (nothing cached yet) and follow-up turns."""
    samples: dict[str, list[float]] = {name: [] for name in routers}
    tokens = []
    names = list(routers)
    for i, (endpoint, raw, _) in enumerate(stream):
        for name in names if i % 2 == 0 else reversed(names):
            elapsed, prompt_tokens = decision_ms(routers[name], raw, endpoint)
            samples[name].append(elapsed)
        tokens.append(prompt_tokens)
    out: dict = {"requests": len(stream), "prompt_tokens_mean": statistics.fmean(tokens),
                 "prompt_tokens_max": max(tokens)}
    turns = [turn for _, _, turn in stream]
    for name, values in samples.items():
        out[name] = summary(values)
        if any(turns):
            out[name]["first_turns"] = summary([v for v, t in zip(values, turns, strict=True) if t == 0])
            out[name]["follow_up_turns"] = summary([v for v, t in zip(values, turns, strict=True) if t > 0])
    off, on = out["cache_off"], out["cache_on"]
    out["speedup_p50"] = off["p50_ms"] / on["p50_ms"]
    out["speedup_p99"] = off["p99_ms"] / on["p99_ms"]
    if any(turns):
        out["first_turn_share"] = turns.count(0) / len(turns)
        out["follow_up_speedup_p50"] = off["follow_up_turns"]["p50_ms"] / on["follow_up_turns"]["p50_ms"]
        out["follow_up_speedup_p99"] = off["follow_up_turns"]["p99_ms"] / on["follow_up_turns"]["p99_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=528)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000, help="requests per workload, decision path")
    parser.add_argument("--workloads", default="w3,w4,w4-long")
    parser.add_argument("--gc-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    router = make_router(args.replicas)
    routers = {"cache_off": make_router(args.replicas, chat_cache_tokens=0), "cache_on": make_router(args.replicas)}
    if not routers["cache_on"].hasher.chat_caches[MODEL].enabled:
        raise SystemExit("the chat token cache turned itself off for the bundled tokenizer: nothing to compare")

    tracked_before = len(gc.get_objects())
    full_gc_before_ms = median_ms(gc.collect, args.gc_repeats)
    freeze_startup_heap()
    tracked_after = len(gc.get_objects())
    full_gc_after_ms = median_ms(gc.collect, args.gc_repeats)

    replicas = list(router.replicas.replicas.values())
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    raw = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 32}).encode()
    body = json.loads(raw)
    hashes, _, _ = router.hasher.prompt_block_hashes("completions", body, body["model"])
    # Half the replicas hold the prompt's prefix, as after a few requests of its group.
    for replica in replicas[: args.replicas // 2]:
        router.index.stored(replica.replica_id, hashes[: len(hashes) // 2])
    steps_ms = {
        "json_parse": median_ms(lambda: json.loads(raw), args.repeats),
        "tokenize_and_hash": median_ms(
            lambda: router.hasher.prompt_block_hashes("completions", body, body["model"]), args.repeats),
        "lookup_and_score": median_ms(
            lambda: router.decider.decide(replicas, hashes, hashes[0], None), args.repeats),
    }
    steps_ms["decision_total"] = sum(steps_ms.values())
    chat_steps_ms = {workload: chat_steps(args, router, *shape) for workload, shape in W4_SHAPES.items()}
    print(json.dumps({"chat_steps_median_ms": chat_steps_ms}, indent=2))

    paths = {}
    for workload in args.workloads.split(","):
        if workload == "w3":
            stream = w3_stream(args)
        else:
            stream = w4_stream(args, *W4_SHAPES[workload])
        paths[workload] = side_by_side(stream, routers)
        print(workload, json.dumps({k: v for k, v in paths[workload].items()}))
    cache = routers["cache_on"].hasher.chat_caches[MODEL]

    result = {
        "benchmark": "router_decision",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "parameters": vars(args),
        "decision_median_ms": steps_ms,
        "chat_steps_median_ms": chat_steps_ms,
        "decision_path": paths,
        "chat_cache": {"entries": len(cache), "token_ids_held": cache._held, "hit_tokens": cache.hit_tokens},
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
