"""Greedy decoding on the bundled model equals transformers' generate, token for token (fp32),
whatever the batching, prefix caching, chunking or preemption."""

from __future__ import annotations

import pytest

from kvscale.server.sampling_params import SamplingParams

NEW_TOKENS = 16


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def check_against_reference(outputs, prompts, reference) -> None:
    for i, prompt in enumerate(prompts):
        got = outputs[f"r{i}"].outputs[0].token_ids
        assert got == reference[prompt], f"prompt {i}: {got} != {reference[prompt]}"


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_one_at_a_time(
    make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens, enable_prefix_caching
):
    engine = make_engine(enable_prefix_caching=enable_prefix_caching)
    for i, prompt in enumerate(greedy_prompts):
        engine.add_request(f"r{i}", prompt, greedy())
        outputs = run_to_completion(engine)
        got = outputs[f"r{i}"].outputs[0].token_ids
        assert got == hf_greedy_tokens[prompt], f"prompt {i}: {got} != {hf_greedy_tokens[prompt]}"


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_mixed_batch(
    make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens, enable_prefix_caching
):
    engine = make_engine(enable_prefix_caching=enable_prefix_caching)
    # Twice each prompt: the second copy hits the first one's cached blocks when caching is on.
    prompts = greedy_prompts + greedy_prompts
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    outputs = run_to_completion(engine)
    check_against_reference(outputs, prompts, hf_greedy_tokens)
    # Run again: now every prompt's full blocks are cached (when enabled).
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    again = run_to_completion(engine)
    check_against_reference(again, prompts, hf_greedy_tokens)
    stats = engine.get_stats()
    if enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
        assert any(o.num_cached_tokens > 0 for o in again.values())
    else:
        assert stats.prefix_cache_hits == 0
        assert all(o.num_cached_tokens == 0 for o in again.values())


def test_greedy_tiny_chunks(make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens):
    """A 7-token budget splits every prompt into chunks that straddle block boundaries."""
    engine = make_engine(max_num_batched_tokens=7)
    for i, prompt in enumerate(greedy_prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    outputs = run_to_completion(engine)
    check_against_reference(outputs, greedy_prompts, hf_greedy_tokens)


def test_greedy_under_preemption(make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens, bundled_tokenizer):
    """A pool just large enough for the longest request forces preemption by recompute."""
    longest = max(len(bundled_tokenizer.encode(p)) for p in greedy_prompts) + NEW_TOKENS
    num_blocks = -(-longest // 16) + 1
    engine = make_engine(num_gpu_blocks_override=num_blocks, block_size=16)
    for i, prompt in enumerate(greedy_prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    outputs = run_to_completion(engine)
    check_against_reference(outputs, greedy_prompts, hf_greedy_tokens)
    assert engine.get_stats().num_preemptions > 0


def test_greedy_small_blocks_no_cache(make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens):
    """Block size 4, caching off: many block boundaries inside every prompt."""
    engine = make_engine(block_size=4, enable_prefix_caching=False, num_gpu_blocks_override=512)
    for i, prompt in enumerate(greedy_prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    outputs = run_to_completion(engine)
    check_against_reference(outputs, greedy_prompts, hf_greedy_tokens)
