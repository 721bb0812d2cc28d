"""bench.beam_search's pure parts: transformers' padded beams cut at EOS, and the equality counts."""

from __future__ import annotations

from bench.beam_search import equality_counts, up_to_eos


def test_a_padded_beam_ends_at_its_first_eos():
    assert up_to_eos([5, 9, 2, 2, 2], 2) == [5, 9, 2]
    assert up_to_eos([5, 9, 7], 2) == [5, 9, 7]


def test_counts_the_top_beam_and_every_beam_apart():
    same = [([1, 2], -0.5), ([1, 3], -0.9)]
    top_only = [([1, 2], -0.5), ([4], -1.0)]
    other_top = [([3], -0.4), ([1, 2], -0.5)]
    counts = equality_counts([same, same, same], [same, top_only, other_top])
    assert counts == {"prompts": 3, "top_beam_equal": 2, "all_beams_equal": 1}
