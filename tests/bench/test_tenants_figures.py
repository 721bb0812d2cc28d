"""The tenant benchmark's figures (bench/tenants_figures.py): the exact-limit check, the service
gap over every window and VTC's bound."""

from __future__ import annotations

from bench.tenants_figures import at_most, limit_outcome, service_gap, vtc_bound


def _answer(status: int, retry_after: str | None = None, code: str | None = None) -> dict:
    return {"status": status, "retry_after": retry_after, "error_code": code}


def test_a_limit_is_exact_only_when_the_first_n_pass_and_every_later_one_is_a_well_formed_429() -> None:
    refusal = _answer(429, "12", "rate_limit_exceeded")
    exact = limit_outcome([_answer(200)] * 3 + [refusal] * 2, 3)
    assert exact == {"sent": 5, "admitted": 3, "refused": 2, "other": 0, "first_refused": 4,
                     "refusals_well_formed": True, "exact": True}
    # One request too many let in (two routers counting apart would do this).
    assert not limit_outcome([_answer(200)] * 4 + [refusal], 3)["exact"]
    # One too few: a refusal before the limit was reached.
    assert not limit_outcome([_answer(200), refusal, _answer(200), refusal], 3)["exact"]
    # The right count, but a 429 without Retry-After, or with another code.
    without_retry = limit_outcome([_answer(200)] * 3 + [_answer(429, None, "rate_limit_exceeded")], 3)
    assert not without_retry["refusals_well_formed"] and not without_retry["exact"]
    assert not limit_outcome([_answer(200)] * 3 + [_answer(429, "3", "overloaded")], 3)["exact"]


def test_the_service_gap_is_the_largest_difference_over_any_window_not_only_from_the_start() -> None:
    # a is served 10, 10, then b 5, 5, 5, 5: the running difference goes 10, 20, 15, 10, 5, 0.
    served = [(1.0, "a", 10), (2.0, "a", 10), (3.0, "b", 5), (4.0, "b", 5), (5.0, "b", 5), (6.0, "b", 5)]
    assert service_gap(served, "a", "b", 0.0, 10.0) == 20
    # Over [2.5, 10] only b is served: a gap of 20 the other way.
    assert service_gap(served, "a", "b", 2.5, 10.0) == 20
    # The window's bounds are honoured (out-of-order records too) and other tenants ignored.
    shuffled = [served[3], (1.5, "c", 100), *served[:3]]
    assert service_gap(shuffled, "a", "b", 0.0, 3.5) == 20
    # A dip below zero then a rise above: the window spans both.
    swing = [(1.0, "b", 7), (2.0, "a", 4), (3.0, "a", 9)]
    assert service_gap(swing, "a", "b", 0.0, 5.0) == 13
    assert service_gap([], "a", "b", 0.0, 1.0) == 0


def test_vtc_bound_is_twice_the_larger_of_the_longest_prompt_and_the_batch_s_tokens() -> None:
    # 4 slots of requests of at most 40 tokens: 160 tokens in the batch, more than any prompt.
    assert vtc_bound(largest_prompt=20, largest_request=40, batch_requests=4, kv_tokens=2048) == 320
    # A KV cache smaller than the slots could fill caps the batch.
    assert vtc_bound(largest_prompt=20, largest_request=40, batch_requests=4, kv_tokens=64) == 128
    # A prompt longer than the batch can hold (the batch's prefill is chunked) sets it.
    assert vtc_bound(largest_prompt=500, largest_request=510, batch_requests=1, kv_tokens=256) == 1000


def test_at_most_says_met_not_met_or_not_measured() -> None:
    assert at_most(0.2, 0.3) == "met"
    assert at_most(0.31, 0.3) == "not met"
    assert at_most(None, 0.3) == at_most(float("nan"), 0.3) == "not measured"


def test_the_machine_note_says_the_load_the_run_measured() -> None:
    from bench.tenants import load_note

    assert load_note(0.5, 3.251, 2) == "1-min load average 0.50 at the start, 3.25 at the end, on 2 CPUs"
    assert load_note(12.0, 9.0, 2) != load_note(0.5, 3.251, 2)
