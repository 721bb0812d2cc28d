"""Constrained decoding inside the engine on the bundled model: grammars that wait outside the
scheduler, matchers through forks, preemption, aborts, min_tokens, logprobs and seeds, and the
error output of a grammar that cannot be compiled. Every engine is leak-checked."""

from __future__ import annotations

import json
import threading

import jsonschema

from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def person_spec() -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(PERSON, separators=(",", ":")))


def test_every_sample_of_n_validates_and_seeds_repeat(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine()
    prompt = chat_prompt(bundled_tokenizer, "Describe a person as JSON.")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, structured_outputs=person_spec(),
                            logprobs=2)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, SamplingParams(**{**params.__dict__}))
    done = run_to_completion(engine)
    for output in done.values():
        assert len(output.outputs) == 3
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), PERSON)
            else:
                assert completion.finish_reason == "length"
            # Top alternatives are allowed tokens only: never -inf.
            assert all(lp.logprob > float("-inf") for position in completion.logprobs for lp in position.values())
    assert [c.text for c in done["a"].outputs] == [c.text for c in done["b"].outputs]


def test_a_grammar_that_fails_ends_the_request_with_an_error_and_nothing_else(make_engine, run_to_completion,
                                                                              bundled_tokenizer):
    engine = make_engine()
    bad = StructuredOutputsParams(json='{"type":"array","uniqueItems":true}')
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=8, structured_outputs=bad))
    engine.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=8))
    done = run_to_completion(engine)
    assert "uniqueItems" in done["bad"].error
    assert done["bad"].outputs[0].token_ids == []
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 8


def slow_spec(offset: int) -> StructuredOutputsParams:
    """A schema that takes ~0.5 s of CPU time to compile (Xeon); ``offset`` keeps each one uncached."""
    return StructuredOutputsParams(json=json.dumps({"anyOf": [{"type": "object", "properties": {
        f"k{j}": {"type": "integer", "minimum": j + offset, "maximum": j * 1000 + offset + 7}
        for j in range(i, i + 30)},
        "required": [f"k{i}"]} for i in range(250)]}))


def test_compiles_over_the_cpu_limit_fail_their_own_requests_and_nobody_waits_behind_them(
        make_engine, run_to_completion):
    """Over the CPU-time limit: "timeout" (a 400 at the API), and the worker is handed over, so a
    small schema queued behind two slow ones compiles and a plain request decodes to the end."""
    from kvscale.server.config import StructuredOutputsConfig

    # A wait bound no step of a loaded machine reaches: only the CPU limit may end these.
    engine = make_engine(structured_outputs_config=StructuredOutputsConfig(
        compile_timeout_s=0.05, compile_wait_timeout_s=60.0, compile_priority="normal"))
    engine.structured.compiler.tokenizer()  # else the first compile builds it
    engine.add_request("slow", "Hello", SamplingParams(max_tokens=8, structured_outputs=slow_spec(0)))
    engine.add_request("slow2", "Hello", SamplingParams(max_tokens=8, structured_outputs=slow_spec(1)))
    engine.add_request("queued", "Hello", SamplingParams(max_tokens=8, structured_outputs=person_spec()))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
    done = run_to_completion(engine)
    for slow in ("slow", "slow2"):
        assert done[slow].error_reason == "timeout" and "compile_timeout_s" in done[slow].error
        assert done[slow].outputs[0].token_ids == []
    assert done["queued"].error is None and done["queued"].outputs[0].token_ids
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == 8
    assert engine.structured.stats.timeouts == 2 and engine.structured.stats.wait_timeouts == 0


def test_a_compile_waited_for_past_the_wall_clock_bound_ends_with_wait_timeout(make_engine, run_to_completion):
    """A compile that gets no CPU (as a starved worker's) holds the one worker past the wall-clock
    bound: it and the request queued behind it end with "wait_timeout" (a 503); a plain request
    beside them decodes to the end."""
    from kvscale.server.config import StructuredOutputsConfig

    engine = make_engine(structured_outputs_config=StructuredOutputsConfig(
        compile_timeout_s=0.5, compile_wait_timeout_s=0.6, compile_workers=1, compile_priority="normal"))
    pool = engine.structured.compiler.pool
    compile_fn, released = pool._compile_fn, threading.Event()
    held = slow_spec(0)

    def held_then_compiled(tokenizer, spec):
        if spec == held:
            released.wait(30)  # off the CPU: its CPU clock stays below the limit
        return compile_fn(tokenizer, spec)

    pool._compile_fn = held_then_compiled
    try:
        engine.add_request("held", "Hello", SamplingParams(max_tokens=8, structured_outputs=held))
        engine.add_request("queued", "Hello", SamplingParams(max_tokens=8, structured_outputs=person_spec()))
        engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
        done = run_to_completion(engine)
    finally:
        released.set()
    for waited in ("held", "queued"):
        assert done[waited].error_reason == "wait_timeout" and "compile_wait_timeout_s" in done[waited].error
        assert done[waited].outputs[0].token_ids == []
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == 8
    assert engine.structured.stats.timeouts == 0 and engine.structured.stats.wait_timeouts == 2


def test_abort_while_compiling_and_while_decoding_leaks_nothing(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine()
    prompt = chat_prompt(bundled_tokenizer, "JSON please")
    engine.add_request("waiting", prompt, SamplingParams(max_tokens=30, structured_outputs=person_spec()))
    engine.abort_request("waiting")  # still waiting for its grammar: never reached the scheduler
    engine.add_request("decoding", prompt, SamplingParams(max_tokens=30, structured_outputs=person_spec()))
    while not any(seq.num_output_tokens for seq in engine.requests["decoding"].seqs):
        engine.step()
    engine.abort_request("decoding")
    run_to_completion(engine)
    assert not engine.structured.matchers and not engine.structured.pending


def test_min_tokens_never_forces_a_token_the_grammar_forbids(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine()
    spec = StructuredOutputsParams(choice=["yes", "no"])
    engine.add_request("c", "Is water wet? Answer:", SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                                                    structured_outputs=spec))
    done = run_to_completion(engine)
    assert done["c"].outputs[0].text in ("yes", "no")
    assert done["c"].outputs[0].finish_reason == "stop"


def test_preempted_constrained_sequences_resume_valid(make_engine, run_to_completion, bundled_tokenizer):
    # A pool this small preempts some of the batch by recompute; their matchers stay in step.
    engine = make_engine(num_gpu_blocks_override=12, max_num_seqs=8)
    numbers = {"type": "array", "items": {"type": "integer"}, "maxItems": 40}
    spec = StructuredOutputsParams(json=json.dumps(numbers))
    for i in range(6):
        prompt = chat_prompt(bundled_tokenizer, f"List {i + 20} numbers as a JSON array, please, friend {i}.")
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=60,
                                                           structured_outputs=spec))
    done = run_to_completion(engine)
    assert engine.get_stats().num_preemptions > 0
    for output in done.values():
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), numbers)
        else:
            assert completion.finish_reason == "length"


def test_regex_and_grammar_constraints(make_engine, run_to_completion):
    engine = make_engine()
    engine.add_request("re", "My phone code:", SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")))
    engine.add_request("lark", "Say hi:", SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar='start: "hi" " " NAME\nNAME: /[a-z]{1,8}/')))
    done = run_to_completion(engine)
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", done["re"].outputs[0].text)
    lark = done["lark"].outputs[0]
    assert re.fullmatch(r"hi [a-z]{1,8}", lark.text) or lark.finish_reason == "length"


def test_logit_bias_moves_the_greedy_choice(make_engine, run_to_completion, bundled_tokenizer):
    engine = make_engine()
    target = bundled_tokenizer.encode(" banana")[0]
    engine.add_request("plain", "The capital of France is", SamplingParams(temperature=0, max_tokens=1))
    engine.add_request("biased", "The capital of France is", SamplingParams(
        temperature=0, max_tokens=1, logit_bias={target: 100.0}))
    done = run_to_completion(engine)
    assert done["plain"].outputs[0].token_ids != [target]
    assert done["biased"].outputs[0].token_ids == [target]


def test_masks_filled_during_the_forward_give_what_masks_filled_after_it_give(
        make_engine, run_to_completion, bundled_tokenizer, monkeypatch):
    """The step starts filling the scheduled rows' masks before the forward pass (the manager's
    start_masks) and collects them after it; rows it did not foresee (the n > 1 forks made at
    sampling) are filled then. Same tokens as filling every mask after the forward."""
    from kvscale.server.structured_outputs.manager import StructuredOutputManager

    prompt = chat_prompt(bundled_tokenizer, "Describe a person as JSON.")

    def run() -> dict:
        engine = make_engine()
        engine.add_request("greedy", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                            structured_outputs=person_spec()))
        engine.add_request("forks", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40,
                                                           structured_outputs=person_spec()))
        engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=12))
        done = run_to_completion(engine)
        assert engine.structured.early is None  # collected or settled, never left running
        return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}

    started: list[int] = []
    original = StructuredOutputManager.start_masks

    def counting(self, seqs):
        original(self, seqs)
        started.append(len(self.early.seq_ids) if self.early is not None else 0)

    monkeypatch.setattr(StructuredOutputManager, "start_masks", counting)
    early = run()
    assert sum(started) > 0  # the early path ran
    monkeypatch.setattr(StructuredOutputManager, "start_masks", lambda self, seqs: None)
    assert run() == early
