"""Speculative decoding, single stream: kvscale off, n-gram and suffix, and vLLM's CPU build, in one run.

Three engines in this process with the same flags, one without ``--speculative-config``, one
with n-gram and one with suffix drafts, and vLLM's CPU build (bench/anchors/vllm_stream.py:
kept alive in its own venv, without and with its own n-gram speculation; its suffix method is
tried and its refusal recorded) run the same input-grounded requests one at a time: chat prompts
asking the model to repeat or lightly edit a passage given in the prompt (the same token ids
everywhere, greedy, the same ``max_tokens``), the kind of output prompt lookup serves. Each
round runs one pass of every side, the order rotating each round (drift in the machine's load
falls on all sides), after one untimed pass each. Per pass: output tokens, steps (kvscale),
wall time, drafts and accepted tokens; summary: medians of tok/s, paired median ratios, the
acceptance rates, and how many answers are token for token those of kvscale without speculation.

The suffix side runs with ``suffix_decoding_max_cached_requests`` 0 by default: every pass asks
the same prompts again, so cached responses would be the answers themselves, a repetition no
real workload promises.

    /tmp/quiet python -m bench.spec_decode

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


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}'


def prompts_of(tokenizer: Any) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": ask.format(passage)}],
                                          add_generation_prompt=True, tokenize=False)
            for passage in PASSAGES for ask in ASKS]


def one_pass(engine: LLMEngine, prompts: list[str], max_tokens: int, tag: str) -> dict[str, Any]:
    """Every prompt once, one at a time (single stream); the prompts' token ids too (vLLM's input)."""
    before = engine.get_stats().extra
    answers: list[list[int]] = []
    prompt_ids: list[list[int]] = []
    steps = 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            steps += 1
            for output in engine.step():
                if output.finished:
                    answers.append(output.outputs[0].token_ids)
                    prompt_ids.append(output.prompt_token_ids)
    seconds = time.perf_counter() - started
    after = engine.get_stats().extra
    tokens = sum(len(a) for a in answers)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return {"seconds": seconds, "output_tokens": tokens, "steps": steps, "tok_s": tokens / seconds,
            "draft_tokens": delta("spec_decode_num_draft_tokens_total"),
            "accepted_tokens": delta("spec_decode_num_accepted_tokens_total"), "answers": answers,
            "prompt_ids": prompt_ids}


def paired(passes: dict[str, list[dict]], top: str, bottom: str) -> dict[str, float]:
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(passes[top], passes[bottom], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ngram-config", default=NGRAM, help="the n-gram sides' --speculative-config")
    parser.add_argument("--suffix-config", default=SUFFIX, help="kvscale's suffix side's --speculative-config")
    parser.add_argument("--no-vllm", action="store_true", help="kvscale's sides only")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (vLLM: cores)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = os.getloadavg()
    engines = {"kvscale_off": LLMEngine(EngineConfig(**ENGINE)),
               "kvscale_ngram": LLMEngine(EngineConfig(**ENGINE, speculative_config=SpeculativeConfig.from_json(
                   args.ngram_config))),
               "kvscale_suffix": LLMEngine(EngineConfig(**ENGINE, speculative_config=SpeculativeConfig.from_json(
                   args.suffix_config)))}
    prompts = prompts_of(engines["kvscale_off"].tokenizer)
    # vLLM computes in the dtype kvscale's "auto" resolved to on this CPU (bfloat16 where the CPU
    # multiplies bf16 in hardware, else float32): the ratios compare engines, not precisions.
    dtype_name = str(engines["kvscale_off"].runner.dtype).removeprefix("torch.")
    vllm: dict[str, Any] = {}
    vllm_refused: dict[str, str] = {}
    vllm_info: dict[str, Any] = {}
    if not args.no_vllm:
        from bench.anchors.vllm_stream import VllmStream

        for side, config in (("vllm_suffix", {"method": "suffix", "num_speculative_tokens": 8}),
                             ("vllm_off", None), ("vllm_ngram", json.loads(args.ngram_config))):
            stream = VllmStream(threads=args.threads, speculative_config=config, max_model_len=ENGINE["max_model_len"],
                                dtype=dtype_name)
            if stream.refused is not None:
                vllm_refused[side] = stream.refused
                print(f"{side}: vLLM refused it: {stream.refused[:300]}", flush=True)
            else:
                vllm[side], vllm_info[side] = stream, stream.info

    prompt_ids: list[list[int]] = []

    def run(side: str, tag: str) -> dict[str, Any]:
        if side in engines:
            result = one_pass(engines[side], prompts, args.max_tokens, tag)
            prompt_ids[:] = result.pop("prompt_ids")
            return result
        return vllm[side].run_pass(prompt_ids, args.max_tokens)

    sides = [*engines, *vllm]
    try:
        for side in sides:  # untimed: first-use costs, prompts prefix-cached
            run(side, f"warm-{side}")
        passes: dict[str, list[dict]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side in sides[round_ % len(sides):] + sides[:round_ % len(sides)]:
                result = run(side, f"r{round_}-{side}")
                passes[side].append(result)
                print(f"round {round_} {side}: {result['tok_s']:.1f} tok/s, {result.get('steps', '-')} steps, "
                      f"{result['accepted_tokens']:.0f}/{result['draft_tokens']:.0f} drafts accepted", flush=True)
    finally:
        for stream in vllm.values():
            stream.close()
    reference = passes["kvscale_off"][0]["answers"]
    summary: dict[str, Any] = {"requests": len(prompts), "output_tokens": passes["kvscale_off"][0]["output_tokens"]}
    for side in sides:
        first = passes[side][0]
        summary[side] = {
            "tok_s_median": statistics.median(p["tok_s"] for p in passes[side]),
            "output_tokens": first["output_tokens"], "steps": first.get("steps"),
            "acceptance_rate": first["accepted_tokens"] / max(first["draft_tokens"], 1.0),
            "draft_tokens": first["draft_tokens"],
            "answers_token_identical_to_kvscale_off": sum(
                a == b for a, b in zip(first["answers"], reference, strict=True)),
        }
    ratios = {f"{top}/{bottom}": paired(passes, top, bottom)
              for top, bottom in (("kvscale_ngram", "kvscale_off"), ("kvscale_suffix", "kvscale_off"),
                                  ("kvscale_ngram", "vllm_off"), ("kvscale_suffix", "vllm_off"),
                                  ("kvscale_ngram", "vllm_ngram"), ("kvscale_suffix", "vllm_ngram"),
                                  ("vllm_ngram", "vllm_off"), ("kvscale_off", "vllm_off"))
              if top in passes and bottom in passes}
    summary["tok_s_ratio_paired"] = ratios
    summary["vllm_refused"] = vllm_refused
    for side_passes in passes.values():
        for p in side_passes:
            p.pop("answers")
    print(json.dumps(summary, indent=1), flush=True)
    result = {
        "benchmark": "spec_decode",
        "command": " ".join(["python -m bench.spec_decode", *sys.argv[1:]]),
        "started_at": started_at,
        "machine": {**machine(), "cpu": cpu_isa(), "torch_threads": torch.get_num_threads(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "flags": {**vars(args), "engine": ENGINE, "dtype_resolved": dtype_name},
        "vllm": vllm_info,
        "summary": summary,
        "passes": passes,
    }
    print(write_result("spec_decode", result, args.out))


if __name__ == "__main__":
    main()
