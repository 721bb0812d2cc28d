"""Fast-forward of grammar-forced tokens on the bundled model: greedy answers are the same token
for token with it on and off (n > 1, deltas, stop strings, max_tokens cutting a forced run,
preemption), in fewer steps; requests with logprobs or logit_bias are never fast-forwarded.
Every engine is leak-checked (conftest.make_engine)."""

from __future__ import annotations

import json

from kvscale.server.config import StructuredOutputsConfig
from kvscale.server.engine.output_builder import OutputKind
from kvscale.server.outputs import merge_deltas
from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams
from kvscale.server.structured_outputs.manager import fast_forward_allowed, forced_run

# Long keys: the grammar forces each one (several tokens) once its opening quote is sampled.
WEATHER = {"type": "object", "properties": {
    "weather_condition_description": {"type": "string", "maxLength": 20},
    "temperature_in_celsius": {"type": "integer", "minimum": -50, "maximum": 60}},
    "required": ["weather_condition_description", "temperature_in_celsius"], "additionalProperties": False}
# After the name, the grammar forces "; Occupation: software engineer" (six tokens) in one run.
OCCUPATION = 'start: "Name: " NAME "; Occupation: software engineer"\nNAME: /[A-Z][a-z]{1,8}/'
CUTS = list(range(4, 14))


def test_forced_run_leaves_stop_and_eos_ids_to_sampling():
    assert forced_run([5, 6, 7], [], {0}) == [5, 6, 7]
    assert forced_run([5, 6, 7], [6], {0}) == [5]
    assert forced_run([5, 0, 7], [], {0}) == [5]
    assert forced_run([], [6], {0}) == []


def test_fast_forward_is_not_for_logprobs_or_logit_bias():
    assert fast_forward_allowed(SamplingParams())
    assert not fast_forward_allowed(SamplingParams(logprobs=0))
    assert not fast_forward_allowed(SamplingParams(logit_bias={5: -100.0}))


def test_config_refuses_a_non_boolean_fast_forward():
    import pytest

    with pytest.raises(ValueError, match="fast_forward"):
        StructuredOutputsConfig(fast_forward="false")  # type: ignore[arg-type]


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def requests(tokenizer) -> dict[str, tuple[str, SamplingParams]]:
    weather = StructuredOutputsParams(json=json.dumps(WEATHER))
    occupation = StructuredOutputsParams(grammar=OCCUPATION)
    greedy = {"temperature": 0}
    out = {
        "weather": (chat(tokenizer, "The weather today as JSON."),
                    SamplingParams(max_tokens=80, structured_outputs=weather, **greedy)),
        "weather_n2": (chat(tokenizer, "Weather in Oslo as JSON."),
                       SamplingParams(n=2, max_tokens=80, structured_outputs=weather, **greedy)),
        "choice": ("The capital of Germany is", SamplingParams(
            max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["Paris, France", "Berlin, Germany"]),
            **greedy)),
        # The stop string lies inside the forced run: the answer ends there as without fast-forward.
        "stop_inside_run": (chat(tokenizer, "Who are you?"), SamplingParams(
            max_tokens=40, stop=["Occupation"], structured_outputs=occupation, **greedy)),
    }
    # A stop token id inside the forced run is left to sampling, which ends the answer on it.
    engineer = tokenizer.encode(" engineer")
    assert len(engineer) == 1
    out["stop_id_inside_run"] = (chat(tokenizer, "Who are you?"), SamplingParams(
        max_tokens=40, min_tokens=3, stop_token_ids=engineer, structured_outputs=occupation, **greedy))
    out["full"] = (chat(tokenizer, "Who are you?"), SamplingParams(max_tokens=40, structured_outputs=occupation,
                                                                   **greedy))
    # max_tokens ending at every position of the answer, through its six-token forced run.
    for max_tokens in CUTS:
        out[f"cut{max_tokens}"] = (chat(tokenizer, "Who are you?"), SamplingParams(
            max_tokens=max_tokens, structured_outputs=occupation, **greedy))
    return out


def run(engine, batch: dict[str, tuple[str, SamplingParams]], deltas: bool) -> tuple[dict, int]:
    engine.output_kind = OutputKind.DELTA if deltas else OutputKind.CUMULATIVE
    for request_id, (prompt, params) in batch.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    # Deltas merged as a streaming client sees them; cumulative outputs: the last is the answer.
    return {rid: merge_deltas(outs) if deltas else outs[-1] for rid, outs in outputs.items()}, steps


def summary(output) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def test_greedy_answers_are_the_same_with_fast_forward_in_fewer_steps(make_engine, bundled_tokenizer):
    batch = requests(bundled_tokenizer)
    on = make_engine(structured_outputs_config=StructuredOutputsConfig(fast_forward=True))
    off = make_engine(structured_outputs_config=StructuredOutputsConfig(fast_forward=False))
    # Grammars compile on idle-priority threads: on a busy machine a first run's requests wait for
    # them a varying number of steps (160 against 35 once). Each engine runs the batch once first,
    # its grammars then compiled, so the steps counted are the answers' alone.
    run(on, batch, deltas=True)
    run(off, batch, deltas=False)
    got_on, steps_on = run(on, batch, deltas=True)  # deltas, as the server streams them
    got_off, steps_off = run(off, batch, deltas=False)
    assert set(got_on) == set(got_off) == set(batch)
    for request_id in batch:
        assert summary(got_on[request_id]) == summary(got_off[request_id]), request_id
    assert on.structured.stats.forced_tokens > 0 and off.structured.stats.forced_tokens == 0
    assert on.get_stats().extra["structured_forced_tokens_total"] == on.structured.stats.forced_tokens
    assert steps_on < steps_off
    # What the cases are there to exercise actually happened.
    assert all(c.text == "Berlin, Germany" for c in got_on["choice"].outputs)
    stopped = got_on["stop_inside_run"].outputs[0]
    assert stopped.stop_reason == "Occupation" and stopped.text.endswith("; ")
    assert len(got_on["weather_n2"].outputs) == 2
    by_id = got_on["stop_id_inside_run"].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == bundled_tokenizer.encode(" engineer")[0]
    full = got_on["full"].outputs[0]
    assert full.finish_reason == "stop" and full.text.endswith("; Occupation: software engineer")
    # The last six tokens are the forced run; the cuts end inside it at each of its positions.
    run_start = len(full.token_ids) - 6
    assert CUTS[0] <= run_start and len(full.token_ids) <= CUTS[-1]
    for max_tokens in CUTS:
        completion = got_on[f"cut{max_tokens}"].outputs[0]
        assert completion.token_ids == full.token_ids[:max_tokens]
        assert completion.finish_reason == ("length" if max_tokens < len(full.token_ids) else "stop")


def test_logprobs_requests_sample_every_token(make_engine, bundled_tokenizer, run_to_completion):
    engine = make_engine(structured_outputs_config=StructuredOutputsConfig(fast_forward=True))
    spec = StructuredOutputsParams(json=json.dumps(WEATHER))
    engine.add_request("lp", chat(bundled_tokenizer, "The weather as JSON."), SamplingParams(
        temperature=0, max_tokens=60, logprobs=1, structured_outputs=spec))
    completion = run_to_completion(engine)["lp"].outputs[0]
    assert engine.structured.stats.forced_tokens == 0
    assert len(completion.logprobs) == len(completion.token_ids) > 10
    # Every token's own logprob is the model's, finite: none was appended unseen.
    assert all(position[token].logprob > float("-inf")
               for position, token in zip(completion.logprobs, completion.token_ids, strict=True))


def test_preempted_sequences_with_forced_runs_finish_as_without(make_engine, bundled_tokenizer):
    # A pool this small preempts (by recompute) sequences whose forced run is not yet computed.
    spec = StructuredOutputsParams(json=json.dumps(WEATHER))
    batch = {f"p{i}": (chat(bundled_tokenizer, f"Weather in city number {i} as JSON, please."),
                       SamplingParams(temperature=0, max_tokens=50, structured_outputs=spec)) for i in range(6)}
    results = []
    for fast_forward in (True, False):
        engine = make_engine(num_gpu_blocks_override=14, max_num_seqs=6,
                             structured_outputs_config=StructuredOutputsConfig(fast_forward=fast_forward))
        got, _ = run(engine, batch, deltas=False)
        assert engine.get_stats().num_preemptions > 0
        results.append({rid: summary(out) for rid, out in got.items()})
        if fast_forward:
            assert engine.structured.stats.forced_tokens > 0
    assert results[0] == results[1]


def test_only_short_chunks_of_output_tokens_attend_as_decodes():
    from kvscale.server.worker.model_runner import MAX_DECODE_ROWS_CHUNK, attends_as_decodes

    assert attends_as_decodes(start=40, num_new=3, num_prompt_tokens=40)  # sampled token + forced run
    assert not attends_as_decodes(start=40, num_new=1, num_prompt_tokens=40)  # a plain decode already is one
    assert not attends_as_decodes(start=0, num_new=45, num_prompt_tokens=40)  # recompute after preemption
    assert not attends_as_decodes(start=30, num_new=5, num_prompt_tokens=40)  # a prompt's last chunk
    assert not attends_as_decodes(start=40, num_new=MAX_DECODE_ROWS_CHUNK + 1, num_prompt_tokens=40)
