"""Async scheduling (server/core/async_scheduling.py) on the bundled model: the same tokens, ends, cached
block hashes and no leaks as synchronous steps, through preemption, aborts in flight, stop
strings and requests that need the host arriving mid-run.

On CPU nothing overlaps (the host runs the forward), but every bookkeeping path is the GPU's:
placeholders, inputs read from the queued step's tokens, rows dropped after their sequence ended.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import GREEDY_PROMPTS
from kvscale.server.core.async_scheduling import can_overlap, use_async_scheduling
from kvscale.server.core.sequence import PLACEHOLDER_TOKEN
from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams

PROMPTS = [*GREEDY_PROMPTS, "Write a haiku about the sea.", "The three laws of thermodynamics are",
           "In Python, a list comprehension"]


def _params(i: int) -> SamplingParams:
    """Greedy, with every way a sequence ends: its end token, a stop string, max_tokens."""
    if i % 4 == 0:
        return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    if i % 4 == 1:
        return SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "."])
    return SamplingParams(temperature=0, max_tokens=24 + 7 * i)


def _run(engine, run_to_completion, arrivals: dict[int, list[tuple[str, str | list[int], SamplingParams]]]):
    """Add each request at its step number; step until idle; request id -> final output."""
    finished = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = output
        step += 1
        assert step < 10_000, "engine did not finish"
    return finished


def _summary(outputs) -> dict:
    return {
        rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
        for rid, out in outputs.items()
    }


def test_only_requests_the_device_alone_can_sample_overlap():
    assert can_overlap(SamplingParams(temperature=0, max_tokens=5, stop=["x"], stop_token_ids=[3], ignore_eos=True))
    for needs_host in (
        SamplingParams(temperature=0.8), SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, prompt_logprobs=0), SamplingParams(temperature=0, repetition_penalty=1.2),
        SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, logit_bias={5: 1.0}), SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, n=2),
        SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json_object=True)),
    ):
        assert not can_overlap(needs_host), needs_host


def test_on_by_default_only_where_it_overlaps():
    assert use_async_scheduling(None, torch.device("cuda", 0))
    assert not use_async_scheduling(None, torch.device("cpu"))
    assert use_async_scheduling(True, torch.device("cpu"))
    assert not use_async_scheduling(False, torch.device("cuda", 0))


@pytest.fixture
def pair(make_engine):
    """A synchronous and an async engine with the same small pool (preemption happens)."""
    def build(**overrides):
        settings = {"num_gpu_blocks_override": 20, "max_num_seqs": 8, **overrides}
        return make_engine(async_scheduling=False, **settings), make_engine(async_scheduling=True, **settings)
    return build


def test_same_tokens_ends_and_cached_blocks_through_preemption(pair, run_to_completion):
    sync, overlapped = pair()
    arrivals = {0: [(f"r{i}", p, _params(i)) for i, p in enumerate(PROMPTS[:5])],
                3: [(f"r{i}", p, _params(i)) for i, p in enumerate(PROMPTS[5:], start=5)]}
    want = _run(sync, run_to_completion, arrivals)
    got = _run(overlapped, run_to_completion, arrivals)
    assert _summary(got) == _summary(want)
    assert {o.outputs[0].finish_reason for o in got.values()} == {"stop", "length"}
    assert overlapped.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    # Every block registered by hash is one a synchronous engine registers: no placeholder hashed.
    assert set(overlapped.cached_block_hashes()) == set(sync.cached_block_hashes())
    assert overlapped.num_generated_tokens == sync.num_generated_tokens
    assert overlapped.num_prompt_tokens_computed == sync.num_prompt_tokens_computed


def test_the_next_step_is_queued_before_the_tokens_are_read(make_engine):
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert engine.step() == []  # the prefill's token is still on the device
    seq = engine.requests["a"].seqs[0]
    assert seq.token_ids[-1] == PLACEHOLDER_TOKEN and engine.in_flight is not None
    outputs = engine.step()  # queues the first decode, then reads the prefill's token
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1]
    assert seq.token_ids[-1] == PLACEHOLDER_TOKEN and seq.num_computed_tokens == seq.num_tokens - 1
    while engine.has_unfinished_requests():
        engine.step()


def test_a_steady_decode_batch_takes_its_ids_from_the_queued_step_as_they_are(make_engine):
    """No host list, copy or scatter for the step's ids when every row decodes the row the
    queued step samples (a GPU's usual step); rows that differ take the general path."""
    engine = make_engine(async_scheduling=True)
    prepared = []
    prepare = engine.runner.prepare

    def recording(scheduled, in_flight=None):
        inputs = prepare(scheduled, in_flight)
        prepared.append((inputs[0], in_flight))
        return inputs

    engine.runner.prepare = recording
    for i in range(2):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    ids, in_flight = prepared[-1]
    assert in_flight is not None and ids is in_flight.device_tokens
    engine.add_request("late", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()  # two decodes beside a prompt: not a steady batch
    ids, in_flight = prepared[-1]
    assert in_flight is not None and ids is not in_flight.device_tokens and len(ids) > len(in_flight.seqs)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_request_aborted_in_flight_gets_nothing_more_and_frees_its_blocks(pair, run_to_completion):
    sync, overlapped = pair(num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for engine in (sync, overlapped):
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", prompt, params)
    want = run_to_completion(sync)
    seen: dict[str, int] = {}
    for _ in range(5):
        for output in overlapped.step():
            seen[output.request_id] = len(output.outputs[0].token_ids)
    aborted = overlapped.requests["r1"].seqs[0]
    assert aborted.token_ids[-1] == PLACEHOLDER_TOKEN, "r1 should have a step in flight"
    overlapped.abort_request("r1")
    got = run_to_completion(overlapped)
    assert "r1" not in got
    assert _summary({k: got[k] for k in ("r0", "r2")}) == _summary({k: want[k] for k in ("r0", "r2")})


def test_a_request_that_needs_the_host_turns_steps_synchronous_until_it_ends(make_engine, run_to_completion):
    reference = make_engine(async_scheduling=False)
    engine = make_engine(async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    arrivals = {0: [("a", PROMPTS[0], greedy), ("b", PROMPTS[3], greedy)], 4: [("c", PROMPTS[4], with_logprobs)]}
    want = _run(reference, run_to_completion, arrivals)
    finished = {}
    modes = []
    step = 0
    while step <= 4 or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        modes.append(engine.in_flight is not None)
        step += 1
    assert _summary(finished) == _summary(want)
    c = finished["c"].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    # Overlapped before c arrived, synchronous while it ran, overlapped again after it ended.
    assert modes[:4] == [True] * 4 and modes[4] is False
    assert True in modes[modes.index(False):]


def test_the_flag_has_vllms_spelling_and_reaches_the_engine_config():
    import argparse

    from kvscale.server.config import EngineConfig
    from kvscale.server.entrypoints import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args([]).async_scheduling is None  # unset: on with a GPU, off on CPU
    assert "async_scheduling" in cli_serve._ENGINE_FIELDS and EngineConfig().async_scheduling is None
