"""Speculative decoding (n-gram and suffix) on the bundled model: the same greedy tokens as plain
decoding, drafts accepted, no block leaked, and no block holding a rejected draft ever hashed or
announced."""

from __future__ import annotations

from kvscale.server.config import SpeculativeConfig
from kvscale.server.outputs import BlockStored
from kvscale.server.sampling_params import SamplingParams

# Prompts that repeat their own text, so the model's continuation does too and drafts get accepted.
PROMPTS = [
    "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",
]
BLOCK_SIZE = 4  # small blocks: decode steps fill and register many, drafts straddle them


def run(engine, run_to_completion, tag=""):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24))
    # One request also asks for logprobs: speculation leaves it to plain decoding, same tokens.
    engine.add_request(f"{tag}logprobs", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    return {rid.removeprefix(tag): out.prompt_token_ids + out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}


def test_speculation_gives_plain_greedy_tokens_and_leaks_nothing(make_engine, run_to_completion):
    plain = run(make_engine(block_size=BLOCK_SIZE), run_to_completion)
    check_suffix_decoding(make_engine, run_to_completion, plain)
    engine = make_engine(block_size=BLOCK_SIZE, speculative_config=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    free_at_start = engine.pool.num_free_blocks
    spec = run(engine, run_to_completion)
    assert spec == plain
    stats = engine.get_stats().extra
    assert stats["spec_decode_num_drafts_total"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats["spec_decode_num_draft_tokens_total"]
    assert engine.pool.num_free_blocks == free_at_start
    # Every block announced is an aligned block of a real sequence: none holds a rejected draft.
    real = {tuple(tokens[i:i + BLOCK_SIZE]) for tokens in spec.values()
            for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE)}
    stored = [event for event in engine.drain_kv_events() if isinstance(event, BlockStored)]
    assert stored
    for event in stored:
        chunks = [event.token_ids[i:i + BLOCK_SIZE] for i in range(0, len(event.token_ids), BLOCK_SIZE)]
        assert all(chunk in real for chunk in chunks), event


def check_suffix_decoding(make_engine, run_to_completion, plain):
    """Suffix drafts, from the sequence's own tokens and then from cached responses: plain's tokens."""
    engine = make_engine(block_size=BLOCK_SIZE, speculative_config=SpeculativeConfig.from_json(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_spec_factor": 2}'))
    free_at_start = engine.pool.num_free_blocks
    assert run(engine, run_to_completion) == plain
    first = engine.get_stats().extra
    assert 0 < first["spec_decode_num_accepted_tokens_total"] < first["spec_decode_num_draft_tokens_total"]
    # Again: the first run's answers are cached responses now, and drafts from them are accepted.
    assert run(engine, run_to_completion, tag="again-") == plain
    again = engine.get_stats().extra
    accepted = again["spec_decode_num_accepted_tokens_total"] - first["spec_decode_num_accepted_tokens_total"]
    drafted = again["spec_decode_num_draft_tokens_total"] - first["spec_decode_num_draft_tokens_total"]
    assert accepted / drafted > first["spec_decode_num_accepted_tokens_total"] / first[
        "spec_decode_num_draft_tokens_total"]
    assert engine.spec is not None and engine.spec.responses is not None and len(engine.spec.responses.responses) == 6
    assert engine.pool.num_free_blocks == free_at_start


# Chat prompts whose greedy bf16 answers a 5-row verify step on oneDNN's GEMM changed (its rows
# round differently from a 1-row decode step's): bench/spec_decode.py's.
BF16_PROMPTS = [
    "Rewrite the following text, changing only the numbers to words where needed:\n\nThe library opens at nine in "
    "the morning and closes at six in the evening. Visitors may borrow up to five books at a time for three weeks. "
    "Late returns cost ten cents per day per book.",
    "Repeat the following text exactly, word for word:\n\ndef add(a, b):\n    return a + b\n\n\ndef multiply(a, b):"
    "\n    return a * b\n\n\ndef subtract(a, b):\n    return a - b\n",
]


def test_in_bfloat16_on_bf16_dot_products_speculation_gives_plain_greedy_tokens(make_engine, run_to_completion):
    """Where a step's few bf16 rows run on the dot-product kernel (no AMX, AVX-512 BF16), each
    row's projections are the same bits whatever rows share the step (kernels/cpu_linear_dot.c),
    so a verify step's rows are a decode step's and speculation in bfloat16 keeps plain's tokens."""
    import pytest

    from kvscale.kernels import cpu_native

    if cpu_native.amx_linear_available() or not cpu_native.dot_linear_available():
        pytest.skip("the bf16 dot-product kernel serves CPUs with AVX-512 BF16 and no AMX")

    def answers(engine) -> dict[str, list[int]]:
        for i, ask in enumerate(BF16_PROMPTS):
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                                          add_generation_prompt=True, tokenize=False)
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=48))
        return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}

    plain = answers(make_engine(dtype="bfloat16"))
    engine = make_engine(dtype="bfloat16", speculative_config=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    assert answers(engine) == plain
    assert engine.get_stats().extra["spec_decode_num_accepted_tokens_total"] > 0
