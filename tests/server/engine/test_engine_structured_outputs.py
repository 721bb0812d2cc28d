"""Constrained decoding inside the engine on the bundled model: grammars that wait outside the
scheduler, matchers through forks, preemption, aborts, min_tokens, logprobs and seeds, and the
error output of a grammar that cannot be compiled. Every engine is leak-checked."""

from __future__ import annotations

import json

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


def test_grammar_limits_end_requests_with_their_reason_and_the_batch_runs_on(make_engine, run_to_completion):
    """Over the CPU-time limit: "timeout" (a 400 at the API); queued behind two long compiles past
    the wall-clock bound: "wait_timeout" (a 503); an unconstrained request beside them decodes to
    the end."""
    from kvscale.server.config import StructuredOutputsConfig

    # At the engine's priority: the first compile must reach 0.05 s of CPU time within the 0.6 s
    # bound on a machine that other work may be keeping busy.
    engine = make_engine(structured_outputs_config=StructuredOutputsConfig(
        compile_timeout_s=0.05, compile_wait_timeout_s=0.6, compile_priority="normal"))

    def slow(offset: int) -> StructuredOutputsParams:  # ~0.5 s of CPU time each (Xeon)
        return StructuredOutputsParams(json=json.dumps({"anyOf": [{"type": "object", "properties": {
            f"k{j}": {"type": "integer", "minimum": j + offset, "maximum": j * 1000 + offset + 7}
            for j in range(i, i + 30)},
            "required": [f"k{i}"]} for i in range(250)]}))

    engine.structured.compiler.tokenizer()  # else the first compile builds it (~0.5 s, which the wait counts)
    engine.add_request("slow", "Hello", SamplingParams(max_tokens=8, structured_outputs=slow(0)))
    engine.add_request("slow2", "Hello", SamplingParams(max_tokens=8, structured_outputs=slow(1)))
    # Behind both on the one compile worker, which they keep busy for ~1 s of CPU time, so
    # longer than the 0.6 s bound whatever the load (a thread's wall time is at least its CPU time).
    engine.add_request("queued", "Hello", SamplingParams(max_tokens=8, structured_outputs=person_spec()))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
    done = run_to_completion(engine)
    assert done["slow"].error_reason == "timeout" and "compile_timeout_s" in done["slow"].error
    assert done["queued"].error_reason == "wait_timeout" and "compile_wait_timeout_s" in done["queued"].error
    assert done["queued"].outputs[0].token_ids == []
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == 8
    stats = engine.structured.stats
    assert stats.timeouts >= 1 and stats.wait_timeouts >= 1 and stats.timeouts + stats.wait_timeouts == 3


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
