"""Engine behaviour on the bundled model: prefix hits, seeded sampling, n>1 block sharing,
stop conditions, aborts, admission errors, KV events. Every engine is leak-checked."""

from __future__ import annotations

import pytest

from kvscale.server.outputs import BlockRemoved, BlockStored
from kvscale.server.sampling_params import SamplingParams

LONG_PROMPT = (
    "You are a helpful assistant. Answer briefly and precisely. The following is a long shared "
    "system prompt that many requests start with, so its KV blocks should be computed once and "
    "then reused from the prefix cache by every later request that begins the same way. Question:"
)


def test_prefix_hits_are_counted_and_reused(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine()
    prompt_len = len(bundled_tokenizer.encode(LONG_PROMPT + " one"))
    engine.add_request("a", LONG_PROMPT + " one", SamplingParams(temperature=0, max_tokens=4))
    first = run_to_completion(engine)["a"]
    assert first.num_cached_tokens == 0
    stored = [e for e in engine.drain_kv_events() if isinstance(e, BlockStored)]
    assert len(stored) >= prompt_len // 16
    assert set(engine.cached_block_hashes()) >= {h for e in stored for h in e.block_hashes}

    engine.add_request("b", LONG_PROMPT + " two", SamplingParams(temperature=0, max_tokens=4))
    second = run_to_completion(engine)["b"]
    shared = len(bundled_tokenizer.encode(LONG_PROMPT))
    assert second.num_cached_tokens >= (shared // 16 - 1) * 16 > 0
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == second.num_cached_tokens
    assert stats.prefix_cache_queries >= 2 * prompt_len - 2
    assert stats.kv_blocks_active == 0 and stats.kv_blocks_cached > 0


def test_requests_arriving_together_compute_a_shared_prefix_once(make_engine, run_to_completion, bundled_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = {}
    for name, suffix in (("a", " one"), ("b", " two")):
        engine = make_engine()
        engine.add_request(name, LONG_PROMPT + suffix, params)
        alone[name] = run_to_completion(engine)[name].outputs[0].token_ids

    engine = make_engine()
    engine.add_request("a", LONG_PROMPT + " one", params)
    engine.add_request("b", LONG_PROMPT + " two", params)
    together = run_to_completion(engine)
    shared = len(bundled_tokenizer.encode(LONG_PROMPT))
    # Both are admitted in the first step; b reads the blocks a is filling in that step.
    assert together["a"].num_cached_tokens == 0
    assert together["b"].num_cached_tokens >= (shared // 16 - 1) * 16 > 0
    assert {n: o.outputs[0].token_ids for n, o in together.items()} == alone
    prompt_tokens = sum(len(bundled_tokenizer.encode(LONG_PROMPT + s)) for s in (" one", " two"))
    assert engine.num_prompt_tokens_computed == prompt_tokens - together["b"].num_cached_tokens


def test_cache_salt_prevents_sharing(make_engine, run_to_completion):
    engine = make_engine()
    engine.add_request("a", LONG_PROMPT, SamplingParams(max_tokens=2), cache_salt="alice")
    run_to_completion(engine)
    engine.add_request("b", LONG_PROMPT, SamplingParams(max_tokens=2), cache_salt="bob")
    assert run_to_completion(engine)["b"].num_cached_tokens == 0
    engine.add_request("c", LONG_PROMPT, SamplingParams(max_tokens=2), cache_salt="alice")
    assert run_to_completion(engine)["c"].num_cached_tokens > 0


def test_eviction_emits_block_removed(make_engine, run_to_completion):
    engine = make_engine(num_gpu_blocks_override=8, block_size=16)
    engine.add_request("a", LONG_PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    engine.drain_kv_events()
    # A different prompt needing most of the pool must evict a's cached blocks.
    engine.add_request("b", list(range(100, 100 + 110)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    assert any(isinstance(e, BlockRemoved) for e in engine.drain_kv_events())


def test_seeded_sampling_alone_equals_in_batch(make_engine, run_to_completion, greedy_prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    engine = make_engine()
    engine.add_request("alone", greedy_prompts[1], params)
    alone = run_to_completion(engine)["alone"].outputs[0].token_ids

    engine.add_request("first", greedy_prompts[0], SamplingParams(temperature=1.0, max_tokens=12))
    engine.add_request("seeded", greedy_prompts[1], params)
    engine.add_request("other", greedy_prompts[2], SamplingParams(temperature=1.0, seed=7, max_tokens=12))
    batch = run_to_completion(engine)["seeded"].outputs[0].token_ids
    assert alone == batch


def test_n3_shares_prompt_blocks(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine(enable_prefix_caching=False)
    prompt_ids = bundled_tokenizer.encode(LONG_PROMPT)
    assert len(prompt_ids) % 16 != 0, "the test needs a partial last block"
    prompt_blocks = -(-len(prompt_ids) // 16)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)
    engine.add_request("fork", prompt_ids, params)
    outputs = engine.step()  # the prefill: the prompt is computed once, then forked
    assert engine.get_stats().kv_blocks_active == prompt_blocks
    assert len(outputs) == 1 and len(outputs[0].outputs) == 3
    tables = [seq.block_table for seq in engine.requests["fork"].seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(engine.pool.blocks[b].ref_count == 3 for b in tables[0])

    engine.step()  # first decode: the partial last block is copied for two of the three
    tables = [seq.block_table for seq in engine.requests["fork"].seqs]
    full = len(prompt_ids) // 16
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({t[full] for t in tables}) == 3
    assert engine.get_stats().kv_blocks_active == prompt_blocks + 2

    final = run_to_completion(engine)["fork"]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 3 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1, "three seeded samples all equal"


def test_stop_strings_and_stop_tokens(make_engine, run_to_completion, hf_greedy_tokens, greedy_prompts, bundled_tokenizer):
    engine = make_engine()
    prompt = greedy_prompts[0]
    reference_text = bundled_tokenizer.decode(hf_greedy_tokens[prompt], skip_special_tokens=True)
    stop_word = reference_text.strip().split()[1]  # the second word of the greedy answer
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop_word]))
    engine.add_request("t", prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[hf_greedy_tokens[prompt][2]]))
    out = run_to_completion(engine)
    s = out["s"].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop_word
    assert stop_word not in s.text and reference_text.startswith(s.text)
    t = out["t"].outputs[0]
    assert t.finish_reason == "stop" and t.stop_reason == hf_greedy_tokens[prompt][2]
    assert t.token_ids == hf_greedy_tokens[prompt][:3]


def test_streaming_outputs_are_cumulative(make_engine):
    engine = make_engine()
    engine.add_request("r", "Write a short poem about the sea.", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    texts, finals = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            texts.append(output.outputs[0].text)
            finals += output.finished
    assert finals == 1
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert len(texts) == 10


def test_min_tokens_ignore_eos_logprobs(make_engine, run_to_completion):
    engine = make_engine()
    engine.add_request("r", "Hi", SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3))
    out = run_to_completion(engine)["r"].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert len(out.logprobs) == 6
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy: the chosen is the best
        assert len(position) == 3
        assert all(lp.logprob <= 0 for lp in position.values())


def test_abort_frees_blocks_at_once(make_engine):
    engine = make_engine()
    engine.add_request("a", LONG_PROMPT, SamplingParams(max_tokens=50))
    engine.add_request("b", LONG_PROMPT, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.get_stats().kv_blocks_active > 0
    engine.abort_request("a")
    engine.abort_request("a")  # idempotent
    engine.abort_request("never-existed")
    engine.abort_request("b")
    assert engine.get_stats().kv_blocks_active == 0
    assert not engine.has_unfinished_requests()
    engine.add_request("a", "again", SamplingParams(max_tokens=2))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_admission_errors(make_engine):
    """The edges validate (kvscale.server.entrypoints.admission, tests/server/entrypoints/test_admission.py); the engine
    asserts the same conditions and still refuses a duplicate id."""
    engine = make_engine(max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(AssertionError):
        engine.add_request("e", "", SamplingParams())
    with pytest.raises(AssertionError):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(AssertionError):
        engine.add_request("long", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(AssertionError):
        engine.add_request("vocab", [10**9], SamplingParams())
    engine.add_request("dup", "hello", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    small = make_engine(num_gpu_blocks_override=2, block_size=16)
    assert small.max_model_len == 32  # capped by the pool
    with pytest.raises(AssertionError):
        small.add_request("big", list(range(30)), SamplingParams(max_tokens=8))


def _hf_prompt_logprobs(hf_model, token_ids: list[int]) -> list[float]:
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    all_logprobs = torch.log_softmax(logits, dim=-1)
    return [float(all_logprobs[j - 1, token_ids[j]]) for j in range(1, len(token_ids))]


@pytest.mark.parametrize("budget", [2048, 24])
def test_prompt_logprobs_match_transformers(make_engine, run_to_completion, bundled_tokenizer, hf_bundled_model, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompt_ids = bundled_tokenizer.encode(LONG_PROMPT)
    reference = _hf_prompt_logprobs(hf_bundled_model, prompt_ids)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    # The second request's prompt is fully cached by the first one: it must still be computed,
    # since cached positions have no logits.
    for name in ("first", "again"):
        engine.add_request(name, list(prompt_ids), params)
        output = run_to_completion(engine)[name]
        assert output.num_cached_tokens == 0
        positions = output.prompt_logprobs
        assert len(positions) == len(prompt_ids) and positions[0] is None
        for j, expected in enumerate(reference, start=1):
            chosen = positions[j][prompt_ids[j]]
            assert chosen.logprob == pytest.approx(expected, abs=2e-3), f"prompt token {j}"
            ranked = sorted(positions[j].values(), key=lambda lp: lp.rank)
            assert [lp.rank for lp in ranked][:3] == [1, 2, 3] and len(positions[j]) <= 4
            assert ranked[0].logprob >= chosen.logprob
    # Requests without prompt logprobs still hit the cache the first two filled.
    engine.add_request("plain", list(prompt_ids), SamplingParams(temperature=0, max_tokens=2))
    assert run_to_completion(engine)["plain"].num_cached_tokens > 0
