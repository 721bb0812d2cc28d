"""Speculative decoding's pure parts: n-gram drafts, greedy acceptance, the per-step rule, the flag's JSON."""

from __future__ import annotations

import pytest

from kvscale.server.config import EngineConfig, SpeculativeConfig
from kvscale.server.core.ngram_proposer import propose_ngram
from kvscale.server.core.spec_decode import num_accepted, speculate_this_step


def test_ngram_drafts_continue_the_latest_longest_earlier_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    # The 3-gram [1, 2, 3] last occurred before at index 4: what followed it there.
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]
    assert propose_ngram(tokens, 10, 1, 3) == [4, 5, 6, 7, 1, 2, 3]  # up to the end, not past it
    # Longest first: the 2-gram [7, 8] occurs nowhere earlier, the 1-gram [8] does.
    assert propose_ngram([8, 5, 6, 7, 8], 2, 1, 2) == [5, 6]
    assert propose_ngram([8, 5, 6, 7, 8], 2, 2, 2) == []  # below prompt_lookup_min: none
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([5, 5], 3, 1, 1) == [5]
    assert propose_ngram([5], 3, 1, 1) == [] and propose_ngram([1, 1, 1], 0, 1, 1) == []


def test_ngram_search_skips_byte_matches_that_straddle_tokens():
    # Packed as little-endian int32, [256, 0] is 00 01 00 00 00 00 00 00: the bytes of token 1
    # (01 00 00 00) start at its second byte; only whole-token matches count.
    assert propose_ngram([256, 0, 1], 1, 1, 1) == []
    assert propose_ngram([1, 5, 256, 0, 1], 1, 1, 1) == [5]  # past the straddling hit, the real one
    assert propose_ngram([65536 * 3, 0, 3], 1, 1, 1) == []


def test_acceptance_keeps_drafts_up_to_the_first_mismatch():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1  # draft 6 matched by chance after a miss: cut
    assert num_accepted([4], [3, 8]) == 0
    with pytest.raises(AssertionError):
        num_accepted([4, 5], [4, 5])


def test_speculation_is_off_for_large_batches_and_when_nothing_decodes():
    assert speculate_this_step(1, 4) and speculate_this_step(4, 4)
    assert not speculate_this_step(5, 4) and not speculate_this_step(0, 4)


def test_the_flag_json_is_vllms_spelling_and_refuses_what_is_not_ngram():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 2, 3)
    only_max = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    for text in ('{"method": "eagle", "num_speculative_tokens": 2}', '{"method": "ngram"}',
                 '{"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}',
                 '{"method": "ngram", "num_speculative_tokens": 99}', "[]", "nope",
                 '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(text)
    ngram = SpeculativeConfig(num_speculative_tokens=2)
    for refused in ({"tensor_parallel_size": 2}, {"async_scheduling": True}):
        with pytest.raises(ValueError, match="--speculative-config cannot be combined"):
            EngineConfig(speculative_config=ngram, **refused)
