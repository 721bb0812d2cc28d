"""Beam search on the bundled model: kvscale's beams against transformers' ``generate(num_beams)``,
and the KV blocks a search holds against independent sequences of the same length.

1. Equality: every prompt (chat-templated, float32, greedy beam search of width 4,
   ``length_penalty`` 1 and ``early_stopping`` False, both sides' defaults) through kvscale's
   offline ``LLM.beam_search`` and transformers' ``generate(num_beams=4, num_return_sequences=4)``,
   the stop token kept on both sides. Counts the prompts whose top beam is the same token for
   token (target: at least 3 of every 4), and those whose every beam is.
2. KV blocks: per prompt, the most blocks the engine's block pool holds at once (read after every
   step's scheduling, when every scheduled sequence holds its blocks) during a width-4 search that
   runs to ``max_tokens`` (``ignore_eos``), against 4 sequences of the same prompt decoding the same
   number of tokens, each holding its own blocks (a second engine, prefix caching off: no sharing,
   the baseline of vLLM's paper). Target: the ratio of the sums at most 0.6.

    python -m bench.beam_search

Writes bench/results/beam_search.json (command, machine with CPU model and ISA flags, figures).
The comparison helpers are the tests' too (tests/server/entrypoints/test_beam_search.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kvscale.server.engine.beam_search import BeamSearchOutput, BeamSearchParams, EarlyStopping

Beams = list[tuple[list[int], float]]  # one prompt's beams, best first: generated tokens, score

PROMPTS = [
    "Translate into French: The weather is nice today, so we are going to the beach.",
    "Summarize in one sentence: The city council met on Tuesday to discuss the new park. After a long "
    "debate, the members voted to build it next to the river, with a playground and a small cafe. "
    "Work starts in the spring and should end before winter.",
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "Give a title to this paragraph: Bees visit flowers to collect nectar, and while they do so they "
    "carry pollen from one flower to the next, which lets the plants make seeds.",
    "Explain in two sentences why the sky is blue.",
    "Correct the grammar of this sentence: She don't like apples and he have three cats.",
    "List three things to pack for a weekend hiking trip.",
]


def beam_params(width: int, max_tokens: int, length_penalty: float, early_stopping: EarlyStopping,
                ignore_eos: bool = False) -> BeamSearchParams:
    """kvscale's search as transformers runs ``generate(num_beams=width)``: the stop token kept in
    the returned tokens (transformers' sequences keep it)."""
    return BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                            include_stop_str_in_output=True, early_stopping=early_stopping, ignore_eos=ignore_eos)


def generated_beams(output: BeamSearchOutput, prompt_len: int) -> Beams:
    """kvscale's answer for one prompt as (generated tokens, score), best first."""
    return [(seq.tokens[prompt_len:], seq.score) for seq in output.sequences]


def up_to_eos(generated: list[int], eos_token_id: int) -> list[int]:
    """A transformers beam's tokens through its first EOS (it pads a finished beam with EOS)."""
    return generated[:generated.index(eos_token_id) + 1] if eos_token_id in generated else generated


def hf_beams(hf: Any, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
             early_stopping: EarlyStopping, eos_token_id: int) -> Beams:
    """transformers' ``generate(num_beams=width, num_return_sequences=width)`` for one prompt."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, num_beams=width,
                          num_return_sequences=width, do_sample=False, length_penalty=length_penalty,
                          early_stopping=early_stopping, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                          output_scores=True, return_dict_in_generate=True)
    return [(up_to_eos(row[len(prompt):], eos_token_id), score)
            for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True)]


def equality_counts(got: list[Beams], expected: list[Beams]) -> dict[str, int]:
    """Prompts whose top beam's tokens are the same on both sides, and whose every beam's are."""
    return {"prompts": len(got),
            "top_beam_equal": sum(g[0][0] == e[0][0] for g, e in zip(got, expected, strict=True)),
            "all_beams_equal": sum([t for t, _ in g] == [t for t, _ in e] for g, e in zip(got, expected, strict=True))}


def peak_held_blocks(engine: Any, run: Callable[[], object]) -> int:
    """The most KV blocks ``engine``'s block pool holds at once while ``run`` runs, read after every
    step's scheduling: then each scheduled sequence holds its blocks, and a sequence that ends in
    the step frees them within it."""
    pool, schedule = engine.kv.pool, engine.scheduler.schedule
    peak = 0

    def observed() -> Any:
        nonlocal peak
        scheduled = schedule()
        peak = max(peak, pool.num_active_blocks)
        return scheduled

    engine.scheduler.schedule = observed
    try:
        run()
    finally:
        del engine.scheduler.schedule  # the class's method again
    return peak


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from bench.common import machine, write_result
    from bench.roofline import cpu_isa
    from kvscale.model_files import resolve_model_path
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started_at, load_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    path = resolve_model_path(None)
    engine_flags: dict[str, Any] = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_num_seqs": 64,
                                    "kv_cache_memory_bytes": 512 * 1024**2}
    llm = LLM(str(path), **engine_flags)
    tokenizer = llm.get_tokenizer()
    (eos,) = llm.llm_engine.eos_token_ids  # transformers' generation config names the same one
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for p in PROMPTS]

    params = beam_params(args.width, args.max_tokens, 1.0, False)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    got = [generated_beams(o, len(p)) for o, p in zip(outputs, prompts, strict=True)]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = [hf_beams(hf, p, args.width, args.max_tokens, 1.0, False, eos) for p in prompts]
    equal = equality_counts(got, expected)
    print(f"top beam equal to transformers': {equal['top_beam_equal']} of {equal['prompts']} "
          f"(every beam: {equal['all_beams_equal']})", flush=True)

    separate = LLM(str(path), enable_prefix_caching=False, **engine_flags)
    to_length = beam_params(args.width, args.max_tokens, 1.0, False, ignore_eos=True)
    independent = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    per_prompt = []
    for prompt in prompts:
        one: dict[str, Any] = {"prompt_token_ids": prompt}
        held_beam = peak_held_blocks(llm.llm_engine, partial(llm.beam_search, [one], to_length))
        held_separate = peak_held_blocks(separate.llm_engine, partial(separate.generate, [one] * args.width, independent))
        per_prompt.append({"prompt_tokens": len(prompt), "beam_search_blocks": held_beam,
                           "independent_blocks": held_separate, "ratio": held_beam / held_separate})
    ratio = sum(p["beam_search_blocks"] for p in per_prompt) / sum(p["independent_blocks"] for p in per_prompt)
    print(f"KV blocks, beam search / {args.width} independent sequences: {ratio:.3f}", flush=True)
    result = {
        "benchmark": "beam_search",
        "command": " ".join(["python -m bench.beam_search", *(argv if argv is not None else sys.argv[1:])]),
        "started_at": started_at,
        "machine": {**machine(), "cpu": cpu_isa(), "torch_threads": torch.get_num_threads(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "flags": {**vars(args), "engine": engine_flags, "length_penalty": 1.0, "early_stopping": False},
        "summary": {**equal, "target_top_beam_equal": "at least 3 of 4", "kv_blocks_ratio": ratio,
                    "kv_blocks_ratio_min": min(p["ratio"] for p in per_prompt),
                    "kv_blocks_ratio_max": max(p["ratio"] for p in per_prompt), "target_kv_blocks_ratio": 0.6},
        "kv_blocks": per_prompt,
        "beams": [{"prompt": text, "kvscale": g, "transformers": e}
                  for text, g, e in zip(PROMPTS, got, expected, strict=True)],
    }
    print(write_result("beam_search", result, args.out))


if __name__ == "__main__":
    main()
