"""N-gram speculative decoding, on ÷ off, single stream, in one process on the bundled model.

Two engines with the same flags but one with ``--speculative-config`` (n-gram) run the same
input-grounded requests one at a time: chat prompts asking the model to repeat or lightly edit
a passage given in the prompt (greedy, the same ``max_tokens``), the kind of output prompt lookup
serves. They alternate in pairs (the order flips every pair, so drift in the machine's load falls
on both sides), after one untimed pass each. Per pass: output tokens, engine steps, wall time,
drafts and accepted tokens; summary: medians of tok/s, the paired ratio on ÷ off, acceptance, and
whether the answers are token for token the same.

    flock /tmp/kvscale-bench.lock python -m bench.spec_decode

Writes bench/results/spec_decode.json (command, machine with CPU model and ISA flags, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import machine, write_result
from bench.roofline import cpu_isa
from kvscale.server.config import EngineConfig, SpeculativeConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "auto", "max_model_len": 2048, "max_num_seqs": 8,
                          "max_num_batched_tokens": 2048, "block_size": 16, "kv_cache_memory_bytes": 512 * 1024**2}

PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up "
    "to five books at a time for three weeks. Late returns cost ten cents per day per book.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When the "
    "light turns green, connect to the network named HomeNet with the password printed on the label.",
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return a * b\n\n\n"
    "def subtract(a, b):\n    return a - b\n",
]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}",
        "Rewrite the following text, changing only the numbers to words where needed:\n\n{}"]


def prompts_of(tokenizer: Any) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": ask.format(passage)}],
                                          add_generation_prompt=True, tokenize=False)
            for passage in PASSAGES for ask in ASKS]


def one_pass(engine: LLMEngine, prompts: list[str], max_tokens: int, tag: str) -> dict[str, Any]:
    """Every prompt once, one at a time (single stream)."""
    before = engine.get_stats().extra
    answers: list[list[int]] = []
    steps = 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            steps += 1
            for output in engine.step():
                if output.finished:
                    answers.append(output.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    after = engine.get_stats().extra
    tokens = sum(len(a) for a in answers)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return {"seconds": seconds, "output_tokens": tokens, "steps": steps, "tok_s": tokens / seconds,
            "draft_tokens": delta("spec_decode_num_draft_tokens_total"),
            "accepted_tokens": delta("spec_decode_num_accepted_tokens_total"), "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = os.getloadavg()
    spec = SpeculativeConfig.from_json(args.speculative_config)
    engines = {True: LLMEngine(EngineConfig(**ENGINE, speculative_config=spec)), False: LLMEngine(EngineConfig(**ENGINE))}
    prompts = prompts_of(engines[True].tokenizer)
    for on, engine in engines.items():  # untimed: first-use costs, prompts prefix-cached
        one_pass(engine, prompts, args.max_tokens, f"warm{int(on)}")
    passes: dict[str, list[dict]] = {"on": [], "off": []}
    for pair in range(args.pairs):
        for on in ((True, False) if pair % 2 == 0 else (False, True)):
            side = "on" if on else "off"
            result = one_pass(engines[on], prompts, args.max_tokens, f"p{pair}{side}")
            passes[side].append(result)
            print(f"pair {pair} {side}: {result['tok_s']:.1f} tok/s, {result['steps']} steps, "
                  f"{result['accepted_tokens']:.0f}/{result['draft_tokens']:.0f} drafts accepted", flush=True)
    on_answers, off_answers = passes["on"][0]["answers"], passes["off"][0]["answers"]
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(passes["on"], passes["off"], strict=True)]
    first_on = passes["on"][0]
    summary = {
        "requests": len(prompts),
        "answers_token_identical": sum(a == b for a, b in zip(on_answers, off_answers, strict=True)),
        "output_tokens": first_on["output_tokens"],
        "tok_s_on_median": statistics.median(p["tok_s"] for p in passes["on"]),
        "tok_s_off_median": statistics.median(p["tok_s"] for p in passes["off"]),
        "tok_s_ratio_paired_median": statistics.median(ratios),
        "tok_s_ratio_paired_min": min(ratios),
        "tok_s_ratio_paired_max": max(ratios),
        "acceptance_rate": first_on["accepted_tokens"] / max(first_on["draft_tokens"], 1.0),
        "steps_on": first_on["steps"], "steps_off": passes["off"][0]["steps"],
    }
    for side_passes in passes.values():
        for p in side_passes:
            p.pop("answers")
    print(json.dumps(summary), flush=True)
    result = {
        "benchmark": "spec_decode",
        "command": " ".join(["python -m bench.spec_decode", *sys.argv[1:]]),
        "started_at": started_at,
        "machine": {**machine(), "cpu": cpu_isa(), "torch_threads": torch.get_num_threads(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "flags": {**vars(args), "engine": ENGINE},
        "summary": summary,
        "passes": passes,
    }
    print(write_result("spec_decode", result, args.out))


if __name__ == "__main__":
    main()
