"""beam_step, the pure beam bookkeeping (server/engine/beam_search.py), on hand-made candidates."""

from __future__ import annotations

import math

import pytest

from kvscale.server.engine.beam_search import (
    Beam,
    BeamSearchState,
    beam_score,
    beam_step,
    top_candidates,
)

EOS = 0


def eos_stop(tokens: tuple[int, ...]) -> int | None:
    return EOS if tokens[-1] == EOS else None


def lp(p: float) -> float:
    return math.log(p)


def test_score_is_length_normalized():
    assert beam_score(-6.0, 3, 1.0) == -2.0
    assert beam_score(-6.0, 4, 0.5) == -3.0
    assert beam_score(-6.0, 4, 0.0) == -6.0


def test_first_step_keeps_the_best_width_continuations():
    state = BeamSearchState(beam_width=2, max_tokens=5)
    beam_step(state, [[(1, lp(0.5)), (2, lp(0.3)), (3, lp(0.2))]], eos_stop)
    assert [b.tokens for b in state.live] == [(1,), (2,)]
    assert state.live[0].cum_logprob == pytest.approx(lp(0.5))
    assert not state.finished and not state.done


def test_candidates_are_ranked_across_beams_by_cumulative_logprob():
    state = BeamSearchState(beam_width=2, max_tokens=5)
    state.live = [Beam((1,), lp(0.5), (lp(0.5),)), Beam((2,), lp(0.4), (lp(0.4),))]
    beam_step(state, [[(3, lp(0.5)), (4, lp(0.5))], [(5, lp(0.9)), (6, lp(0.1))]], eos_stop)
    # 0.4 * 0.9 = 0.36 beats 0.5 * 0.5 = 0.25
    assert [b.tokens for b in state.live] == [(2, 5), (1, 3)]
    assert state.live[0].logprobs == pytest.approx((lp(0.4), lp(0.9)))


def test_an_ending_candidate_counts_only_within_the_top_width():
    state = BeamSearchState(beam_width=2, max_tokens=5)
    state.live = [Beam((1,), lp(0.5)), Beam((2,), lp(0.4))]
    # Beam 0's EOS ranks first, beam 1's EOS fourth: only the first becomes a hypothesis.
    beam_step(state, [[(EOS, lp(0.9)), (3, lp(0.1))], [(4, lp(0.5)), (EOS, lp(0.2))]], eos_stop)
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in state.finished] == [((1, EOS), "stop", EOS)]
    assert [b.tokens for b in state.live] == [(2, 4), (1, 3)]
    assert not state.done


def test_max_tokens_ends_the_top_width_with_length():
    state = BeamSearchState(beam_width=2, max_tokens=1)
    beam_step(state, [[(1, lp(0.5)), (2, lp(0.3)), (3, lp(0.2))]], eos_stop)
    assert state.done and not state.live
    assert [(b.tokens, b.finish_reason) for b in state.best()] == [((1,), "length"), ((2,), "length")]


def test_hypotheses_are_ordered_by_normalized_score():
    state = BeamSearchState(beam_width=2, max_tokens=3, length_penalty=1.0)
    state.finished = [Beam((1, EOS), -3.0, finish_reason="stop")]  # score -1.5
    state.live = [Beam((2, 3), -2.0), Beam((4, 5), -2.5)]
    beam_step(state, [[(6, -0.5), (7, -4.0)], [(8, -0.1), (9, -5.0)]], eos_stop)
    # At max_tokens the top two end: -2.5 / 3 and -2.6 / 3, both better than -1.5.
    assert [b.tokens for b in state.best()] == [(2, 3, 6), (4, 5, 8)]
    assert state.done


def test_stops_when_no_live_beam_can_beat_the_worst_hypothesis():
    state = BeamSearchState(beam_width=1, max_tokens=10)
    beam_step(state, [[(EOS, lp(0.6)), (1, lp(0.4))]], eos_stop)
    # The live beam's score at its length already trails the hypothesis.
    assert state.done and state.best()[0].tokens == (EOS,)


def test_never_bounds_by_max_tokens_with_a_positive_length_penalty():
    state = BeamSearchState(beam_width=1, max_tokens=10, early_stopping="never")
    beam_step(state, [[(EOS, lp(0.6)), (1, lp(0.4))]], eos_stop)
    # lp(0.4) / 10 beats lp(0.6) / 1: the live beam might still win.
    assert not state.done


def test_early_stopping_true_stops_at_width_hypotheses_and_takes_no_more():
    state = BeamSearchState(beam_width=2, max_tokens=10, early_stopping=True)
    state.live = [Beam((1,), lp(0.5)), Beam((2,), lp(0.4))]
    beam_step(state, [[(EOS, lp(0.9)), (3, lp(0.1))], [(EOS, lp(0.9)), (4, lp(0.1))]], eos_stop)
    assert state.done and [b.tokens for b in state.best()] == [(1, EOS), (2, EOS)]


def test_refusals():
    with pytest.raises(ValueError, match="beam width"):
        BeamSearchState(beam_width=11, max_tokens=4)
    state = BeamSearchState(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="candidate lists"):
        beam_step(state, [[], []], eos_stop)


def test_top_candidates():
    assert top_candidates({5: -1.0, 6: -0.5, 7: -3.0}, 2) == [(6, -0.5), (5, -1.0)]


def test_each_beam_carries_its_parents_step_records():
    state = BeamSearchState(2, 3)
    beam_step(state, [[(1, lp(0.6)), (2, lp(0.4))]], eos_stop, steps=["first"])
    beam_step(state, [[(3, lp(0.9)), (4, lp(0.1))], [(5, lp(0.5)), (6, lp(0.5))]], eos_stop,
              steps=["after 1", "after 2"])
    assert {beam.tokens: beam.steps for beam in state.live} == {(1, 3): ("first", "after 1"),
                                                                 (2, 5): ("first", "after 2")}
    with pytest.raises(ValueError, match="step records"):
        beam_step(state, [[(7, lp(1.0))], [(8, lp(1.0))]], eos_stop, steps=["one"])
