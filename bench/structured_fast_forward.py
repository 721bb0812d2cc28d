"""Fast-forward of grammar-forced tokens, on ÷ off, in one process on the bundled model.

Two engines with the same flags but ``--structured-outputs-config fast_forward`` true and false
run the same constrained requests (schemas of the shared JSONSchemaBench sample through
``response_format``-style JSON constraints, chat prompts, greedy, the same ``max_tokens``),
alternating on/off in pairs (the order flips every pair, so drift in the machine's load falls on
both sides), each engine's prompts and grammars warmed first so the timed passes compare
decoding. Per pass: output tokens, engine steps, forced tokens, wall time; per concurrency the
medians of constrained decode tok/s and the paired ratio on ÷ off, and steps per output token.
Answers are compared too: greedy on and off should be token for token the same.

    flock /tmp/kvscale-bench.lock python -m bench.structured_fast_forward

Writes bench/results/structured_fast_forward.json (machine, flags, per-pass figures, summary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from bench.common import machine, write_result
from bench.jsonschemabench import load_rows, rows_per_set
from bench.roofline import cpu_isa
from kvscale.server.config import EngineConfig, StructuredOutputsConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams
from kvscale.server.structured_outputs.backend import GrammarError, compile_grammar, grammar_text

# The same engine shape as bench/structured_outputs.py's servers (fp32, prefix caching), in-process.
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_model_len": 4096, "max_num_seqs": 32,
                          "max_num_batched_tokens": 4096, "block_size": 16, "enable_prefix_caching": True,
                          "kv_cache_memory_bytes": 1024**3}


def prompt_of(tokenizer: Any, row: dict) -> str:
    text = json.dumps(row["schema"])[:1500]
    messages = [{"role": "user", "content": f"Write one JSON value that satisfies this JSON schema:\n{text}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def enforceable(engine: LLMEngine, rows: list[dict]) -> list[dict]:
    """The rows whose schema the library compiles (the others would be refused before any token)."""
    tokenizer = engine.structured.compiler.tokenizer()
    kept = []
    for row in rows:
        try:
            compile_grammar(tokenizer, grammar_text(StructuredOutputsParams(json=json.dumps(row["schema"]))))
        except GrammarError:
            continue
        kept.append(row)
    return kept


def one_pass(engine: LLMEngine, prompts: list[str], rows: list[dict], max_tokens: int,
             concurrency: int, tag: str) -> dict[str, Any]:
    """Every request once, at most ``concurrency`` in the engine at a time."""
    forced_before = engine.structured.stats.forced_tokens
    queue = list(range(len(rows)))
    answers: dict[int, list[int]] = {}
    running = 0
    steps = 0
    started = time.perf_counter()
    while queue or running:
        while queue and running < concurrency:
            i = queue.pop(0)
            spec = StructuredOutputsParams(json=json.dumps(rows[i]["schema"]))
            engine.add_request(f"{tag}-{i}", prompts[i], SamplingParams(
                temperature=0, max_tokens=max_tokens, structured_outputs=spec))
            running += 1
        steps += 1
        for output in engine.step():
            if output.finished:
                running -= 1
                assert output.error is None, output.error
                answers[int(output.request_id.rsplit("-", 1)[1])] = output.outputs[0].token_ids
    seconds = time.perf_counter() - started
    tokens = sum(len(t) for t in answers.values())
    return {"seconds": seconds, "output_tokens": tokens, "steps": steps,
            "forced_tokens": engine.structured.stats.forced_tokens - forced_before,
            "tok_s": tokens / seconds, "steps_per_output_token": steps / tokens,
            "answers": [answers[i] for i in range(len(rows))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-set", type=int, default=2, help="schemas from each set of the sample")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--concurrency", default="1,8", help="requests in the engine at once, comma-separated")
    parser.add_argument("--pairs", type=int, default=5, help="on/off pairs per concurrency")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = os.getloadavg()

    engines = {ff: LLMEngine(EngineConfig(**ENGINE, structured_outputs_config=StructuredOutputsConfig(fast_forward=ff)))
               for ff in (True, False)}
    rows = enforceable(engines[True], rows_per_set(load_rows(), args.per_set))
    tokenizer = engines[True].tokenizer
    prompts = [prompt_of(tokenizer, row) for row in rows]
    # Warm both: prompts prefix-cached, grammars compiled and cached, first-use costs paid.
    for ff, engine in engines.items():
        one_pass(engine, prompts, rows, max_tokens=2, concurrency=len(rows), tag=f"warm{int(ff)}")

    results: dict[str, Any] = {}
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        passes: dict[str, list[dict]] = {"on": [], "off": []}
        for ff, engine in engines.items():  # untimed: this concurrency's batch shapes seen once
            one_pass(engine, prompts, rows, args.max_tokens, concurrency, f"c{concurrency}w{int(ff)}")
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for ff in order:
                side = "on" if ff else "off"
                result = one_pass(engines[ff], prompts, rows, args.max_tokens, concurrency, f"c{concurrency}p{pair}{side}")
                passes[side].append(result)
                print(f"concurrency {concurrency} pair {pair} {side}: {result['tok_s']:.1f} tok/s, "
                      f"{result['steps_per_output_token']:.3f} steps/token, {result['forced_tokens']} forced",
                      flush=True)
        on_answers, off_answers = passes["on"][0]["answers"], passes["off"][0]["answers"]
        same = sum(a == b for a, b in zip(on_answers, off_answers, strict=True))
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(passes["on"], passes["off"], strict=True)]
        summary = {
            "requests": len(rows),
            "answers_token_identical": same,
            "output_tokens_on": passes["on"][0]["output_tokens"],
            "output_tokens_off": passes["off"][0]["output_tokens"],
            "forced_tokens": passes["on"][0]["forced_tokens"],
            "forced_share": passes["on"][0]["forced_tokens"] / passes["on"][0]["output_tokens"],
            "tok_s_on_median": statistics.median(p["tok_s"] for p in passes["on"]),
            "tok_s_off_median": statistics.median(p["tok_s"] for p in passes["off"]),
            "tok_s_ratio_paired_median": statistics.median(ratios),
            "tok_s_ratio_paired_min": min(ratios),
            "tok_s_ratio_paired_max": max(ratios),
            "steps_per_output_token_on": passes["on"][0]["steps_per_output_token"],
            "steps_per_output_token_off": passes["off"][0]["steps_per_output_token"],
        }
        for side_passes in passes.values():
            for p in side_passes:
                p.pop("answers")
        results[str(concurrency)] = {"summary": summary, "passes": passes}
        print(json.dumps({"concurrency": concurrency, **summary}), flush=True)

    result = {
        "benchmark": "structured_fast_forward",
        "started_at": started_at,
        "machine": {**machine(), "cpu": cpu_isa(), "loadavg_at_start": load_start,
                    "loadavg_at_end": os.getloadavg()},
        "flags": {**vars(args), "engine": ENGINE},
        "schemas": [row.get("id", row["set"]) for row in rows],
        "results": results,
    }
    print(write_result("structured_fast_forward", result, args.out))


if __name__ == "__main__":
    main()
