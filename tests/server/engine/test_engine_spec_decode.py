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
