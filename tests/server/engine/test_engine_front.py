"""The engine boundary under load: what crosses from the engine's loop to the event loop.

- Outputs are deltas for the server: each step carries only its new text, token ids and
  logprobs, never a copy of everything so far (quadratic in output length).
- Timestamps in an output are a snapshot: a reader one step behind still sees that step's times.
- A list of prompts is admitted in one go, in the same engine step.
- The offline LLM takes finished requests only (``OutputKind.FINAL_ONLY``): a running request
  gets no output built at all.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from kvscale.server.engine.output_builder import OutputKind
from kvscale.server.outputs import RequestOutput, merge_deltas
from kvscale.server.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
from thread_engine import ThreadEngine  # noqa: E402


def _run(engine, request_id: str, prompt, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_outputs_carry_timestamp_snapshots(make_engine) -> None:
    engine = make_engine()
    outputs = _run(engine, "t", "The capital of France is", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outputs) == 4
    times = [o.metrics.last_token_time for o in outputs]
    assert times == sorted(times) and len(set(times)) == 4, times  # one per step, as it was then
    assert outputs[0].metrics.finished_time is None and outputs[-1].metrics.finished_time is not None


def test_delta_outputs_add_up_to_the_cumulative_ones(make_engine) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True, stop=[" named"],
                            prompt_logprobs=1)
    prompt = "Once upon a time, in a small village,"
    cumulative = _run(make_engine(), "c", prompt, params)[-1]

    engine = make_engine()
    engine.output_kind = OutputKind.DELTA
    deltas = _run(engine, "d", prompt, params)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for delta in deltas[1:]:
        assert all(len(c.token_ids) <= 1 for c in delta.outputs), "a delta carries one step's tokens"
        assert delta.prompt_logprobs is None  # sent once, with the first output
        # So is the prompt: a core process would otherwise send every request's whole prompt
        # at every step.
        assert (delta.prompt, delta.prompt_token_ids) == (None, [])
    assert deltas[0].prompt_logprobs == cumulative.prompt_logprobs
    assert (deltas[0].prompt, deltas[0].prompt_token_ids) == (cumulative.prompt, cumulative.prompt_token_ids)
    assert cumulative.prompt_token_ids and cumulative.prompt == prompt

    merged = merge_deltas(deltas)
    assert merged.prompt_token_ids == cumulative.prompt_token_ids
    assert merge_deltas(deltas[1:]).prompt_token_ids == []
    for got, want in zip(merged.outputs, cumulative.outputs, strict=True):
        assert (got.index, got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.index, want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert [sorted(p) for p in got.logprobs] == [sorted(p) for p in want.logprobs]


def test_final_only_gives_each_request_once_as_the_cumulative_answer(make_engine) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True, stop=[" named"],
                            prompt_logprobs=1)
    prompt = "Once upon a time, in a small village,"
    cumulative = _run(make_engine(), "c", prompt, params)
    assert len(cumulative) > 1

    engine = make_engine()
    engine.output_kind = OutputKind.FINAL_ONLY
    final = _run(engine, "f", prompt, params)
    assert len(final) == 1 and final[0].finished
    want = cumulative[-1]
    for got, expected in zip(final[0].outputs, want.outputs, strict=True):
        assert (got.index, got.text, got.token_ids, got.finish_reason, got.stop_reason, got.logprobs) == (
            expected.index, expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason,
            expected.logprobs)
    assert final[0].prompt_logprobs == want.prompt_logprobs


def test_the_offline_llm_asks_for_final_outputs_only() -> None:
    from kvscale.server.entrypoints.llm import LLM

    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=32, max_model_len=128)
    assert llm.llm_engine.output_kind is OutputKind.FINAL_ONLY
    outputs = llm.generate(["The capital of France is", "Two plus two is"],
                           SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_a_list_of_prompts_is_admitted_in_one_go(make_engine) -> None:
    engine = make_engine()
    prompts = [[1, 2, 3, 4 + i] for i in range(4)]

    async def scenario() -> list[RequestOutput]:
        thread_engine = ThreadEngine(engine)
        thread_engine.start()
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            streams = await thread_engine.add_requests(
                [(f"p{i}", ids, params, None) for i, ids in enumerate(prompts)])
            firsts = [await stream.next() for stream in streams]
            for stream in streams:
                while not stream.finished:
                    await stream.next()
            return firsts
        finally:
            await thread_engine.stop()

    firsts = asyncio.run(scenario())
    scheduled = {o.metrics.first_scheduled_time for o in firsts}
    assert len(scheduled) == 1, "all prompts of one request start in the same engine step"
