"""Suffix decoding's pure parts: drafts from the sequence's own tokens and from cached responses,
the draft length following the match length, and the response cache's bounds."""

from __future__ import annotations

import pytest

from kvscale.server.config import SpeculativeConfig
from kvscale.server.core.suffix_proposer import (
    draft_length,
    propose_from_own_tokens,
    propose_from_responses,
    propose_suffix,
)
from kvscale.server.core.suffix_tree import ResponseSuffixTree


def test_own_tokens_draft_the_most_frequent_continuation_while_its_share_holds():
    # [1, 2, 3] occurred twice before: both went on with 4, then one with 5 9 and one with 6 7.
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3]
    draft = propose_from_own_tokens(tokens, 8, 24, 1.0, 0.1)
    # Tie at the second token: the latest occurrence's (6); shares 1, 1/2, 1/2.
    assert (draft.tokens, draft.score, draft.match_len) == ([4, 6, 7], 2.0, 3)
    # The draft may not be less likely than min_token_prob: 1/2 < 0.6 stops after the 4.
    assert propose_from_own_tokens(tokens, 8, 24, 1.0, 0.6).tokens == [4]
    assert propose_from_own_tokens([1, 2, 3], 8, 24, 1.0, 0.1).tokens == []  # no earlier occurrence
    assert propose_from_own_tokens(tokens, 0, 24, 1.0, 0.1).tokens == []


def test_the_draft_length_follows_the_match_length_and_the_tree_depth():
    assert draft_length(3, 16, 24, 1.0) == 3 and draft_length(3, 16, 24, 2.0) == 6
    assert draft_length(3, 2, 24, 2.0) == 2  # num_speculative_tokens caps it
    assert draft_length(20, 16, 24, 1.0) == 4  # the match and the draft fit in the depth
    assert draft_length(1, 16, 24, 0.5) == 0
    tokens = [7, 1, 2, 3, 4, 5, 6, 7]  # a match of 1 token ([7]) continues with 1 2 3 ...
    assert propose_from_own_tokens(tokens, 16, 24, 1.0, 0.1).tokens == [1]
    assert propose_from_own_tokens(tokens, 16, 24, 3.0, 0.1).tokens == [1, 2, 3]
    assert propose_from_own_tokens(tokens, 16, 3, 3.0, 0.1).tokens == [1, 2]  # depth 3: 1 + 2


def test_cached_responses_draft_when_they_match_better_than_the_sequence_itself():
    tree = ResponseSuffixTree(max_depth=8, max_responses=4, max_nodes=1000)
    tree.add([5, 6, 7, 8, 9])
    tree.add([5, 6, 7, 8, 0])
    draft = propose_from_responses(tree, [1, 5, 6], 8, 2.0, 0.1)
    # [5, 6] went on 7 8 in both responses, then 9 or 0 (1/2 each; the first seen wins).
    assert (draft.tokens, draft.score, draft.match_len) == ([7, 8, 9], 2.5, 2)
    assert propose_suffix([1, 5, 6], tree, 8, 8, 2.0, 0.1) == [7, 8, 9]
    # The sequence's own earlier tokens win when they score higher: [5, 6] went on with 3 3 3.
    assert propose_suffix([5, 6, 3, 3, 3, 3, 5, 6], tree, 8, 8, 2.0, 0.1) == [3, 3, 3, 3]
    assert propose_suffix([1, 5, 6], None, 8, 8, 2.0, 0.1) == []


def test_the_response_cache_is_bounded_in_responses_and_nodes_and_frees_what_it_evicts():
    tree = ResponseSuffixTree(max_depth=4, max_responses=2, max_nodes=1000)
    tree.add([1, 2, 3])
    tree.add([4, 5])
    tree.add([6])  # the third: the oldest ([1, 2, 3]) goes, every node of it
    assert list(tree.responses) == [(4, 5), (6,)]
    assert tree.match([1]) is None and tree.match([2, 3]) is None and tree.match([4, 5]) is not None
    assert tree.num_nodes == 1 + 3 + 1  # the root, 4 5 / 5, 6
    # Nodes: a response counts at most max_nodes // max_depth tokens; the oldest go while over.
    small = ResponseSuffixTree(max_depth=4, max_responses=10, max_nodes=10)
    small.add(list(range(20)))
    assert list(small.responses) == [(0, 1)]
    for start in range(100, 140, 2):
        small.add([start, start + 1])
        assert small.num_nodes - 1 <= small.max_nodes
    assert len(small.children) <= 2 * small.max_nodes + 1  # freed ids are reused
    off = ResponseSuffixTree(max_depth=4, max_responses=0, max_nodes=10)
    off.add([1, 2])
    assert not off.responses and off.num_nodes == 1


def test_the_flag_takes_vllms_suffix_keys_and_refuses_out_of_range_or_foreign_ones():
    config = SpeculativeConfig.from_json('{"method": "suffix"}')  # vLLM's defaults; K from the depth
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (16, 24, 10000, 1.0, 0.1)
    config = SpeculativeConfig.from_json(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32, '
        '"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2, '
        '"suffix_decoding_min_token_prob": 0.25}')
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (8, 32, 2, 0.25)
    for fields in ('"suffix_decoding_max_tree_depth": 65', '"suffix_decoding_max_tree_depth": 1',
                   '"suffix_decoding_max_cached_requests": 10001', '"suffix_decoding_max_cached_requests": -1',
                   '"suffix_decoding_max_spec_factor": 0', '"suffix_decoding_min_token_prob": 1.5',
                   '"suffix_decoding_max_tree_depth": 2.5', '"suffix_decoding_min_token_prob": "0.1"',
                   '"prompt_lookup_max": 3', '"suffix_decoding_size": 1'):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(f'{{"method": "suffix", {fields}}}')
    with pytest.raises(ValueError, match="not supported with method 'ngram'"):
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, '
                                    '"suffix_decoding_max_tree_depth": 8}')
