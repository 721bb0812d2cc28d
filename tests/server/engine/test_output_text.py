"""The front end's text for the core's token-id deltas (kvscale.server.engine.output_text), with the
bundled model's tokenizer: the same text as decoding the whole answer, stop strings that end a
sample (and the request, which the core must then abort), text held back while it may still
become a stop string."""

from __future__ import annotations

from kvscale.server.engine.output_text import OutputText
from kvscale.server.outputs import CompletionOutput, Logprob, RequestOutput
from kvscale.server.sampling_params import SamplingParams

PROMPT = "Write a line:"
ANSWER = " The quick brown fox jumps over the lazy dog. Then it sleeps, then it eats."


def delta(request_id: str, prompt_ids: list[int], pieces: dict[int, list[int]],
          finish: dict[int, str] | None = None, finished: bool = False,
          with_logprobs: bool = False) -> RequestOutput:
    finish = finish or {}
    return RequestOutput(
        request_id=request_id, prompt=None, prompt_token_ids=prompt_ids, finished=finished,
        outputs=[CompletionOutput(index, "", list(ids), finish.get(index),
                                  logprobs=[{t: Logprob(-1.0, 1, "")} for t in ids] if with_logprobs else None)
                 for index, ids in pieces.items()])


def test_token_by_token_text_is_the_decoded_answer(bundled_tokenizer) -> None:
    prompt_ids = bundled_tokenizer.encode(PROMPT)
    answer_ids = bundled_tokenizer.encode(ANSWER)
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=64))
    pieces = []
    for i, token in enumerate(answer_ids):
        last = i == len(answer_ids) - 1
        # As the core sends them: only the first delta carries the prompt.
        out = delta("r", prompt_ids if i == 0 else [], {0: [token]}, {0: "length"} if last else None, finished=last)
        assert text.apply(out) is False
        pieces.append(out.outputs[0].text)
    assert "".join(pieces) == bundled_tokenizer.decode(answer_ids)
    assert len(text) == 0  # the finished request is forgotten


def test_a_stop_string_cuts_the_delta_after_its_token_and_ends_the_request(bundled_tokenizer) -> None:
    prompt_ids = bundled_tokenizer.encode(PROMPT)
    answer_ids = bundled_tokenizer.encode(ANSWER)
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=64, stop=["lazy"]))
    # The core ran on past the stop string within one delta (a slow reader, forced tokens).
    out = delta("r", prompt_ids, {0: answer_ids}, with_logprobs=True)
    assert text.apply(out) is True  # the core must abort it
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "stop" and completion.stop_reason == "lazy"
    assert completion.text == " The quick brown fox jumps over the "
    kept = len(completion.token_ids)
    assert "lazy" in bundled_tokenizer.decode(answer_ids[:kept])
    assert "lazy" not in bundled_tokenizer.decode(answer_ids[: kept - 1])
    assert completion.logprobs is not None and len(completion.logprobs) == kept
    assert len(text) == 0
    # What the core sends before it hears of the abort is nobody's.
    late = delta("r", prompt_ids, {0: answer_ids[:2]})
    assert text.apply(late) is False


def test_text_that_may_become_a_stop_string_waits(bundled_tokenizer) -> None:
    prompt_ids = bundled_tokenizer.encode(PROMPT)
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=64, stop=["fox jumps"]))
    shown = []
    for token in bundled_tokenizer.encode(" The quick brown fox"):
        out = delta("r", prompt_ids, {0: [token]})
        text.apply(out)
        shown.append(out.outputs[0].text)
    # " fox" could begin "fox jumps": at most len("fox jumps") - 1 characters are held back.
    assert "".join(shown) == " The quick brown fox"[: -len("fox jump")]
    out = delta("r", prompt_ids, {0: bundled_tokenizer.encode(" runs")}, {0: "length"}, finished=True)
    text.apply(out)
    assert "".join(shown) + out.outputs[0].text == " The quick brown fox runs"


def test_min_tokens_keeps_an_early_stop_string(bundled_tokenizer) -> None:
    prompt_ids = bundled_tokenizer.encode(PROMPT)
    answer_ids = bundled_tokenizer.encode(" The end. The")
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=64, stop=["The"], min_tokens=3))
    out = delta("r", prompt_ids, {0: answer_ids})
    assert text.apply(out) is True
    assert out.outputs[0].text == " The end. "  # the first "The" came before min_tokens


def test_with_n_samples_the_request_ends_when_the_last_one_does(bundled_tokenizer) -> None:
    prompt_ids = bundled_tokenizer.encode(PROMPT)
    stops_early = bundled_tokenizer.encode(" dog. More")
    runs_on = bundled_tokenizer.encode(" cat and more")
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=64, n=2, stop=["dog"]))
    first = delta("r", prompt_ids, {0: stops_early, 1: runs_on[:1]})
    assert text.apply(first) is False and not first.finished
    assert first.outputs[0].finish_reason == "stop" and first.outputs[0].text == " "
    # Sample 0 ended here; the core still sends its tokens until the request ends.
    second = delta("r", [], {0: [42], 1: runs_on[1:]}, {1: "length"})
    assert text.apply(second) is True and second.finished
    assert second.outputs[0].token_ids == [] and second.outputs[0].text == ""
    assert second.outputs[0].finish_reason == "stop"
    assert first.outputs[1].text + second.outputs[1].text == " cat and more"


def test_a_sample_first_seen_in_a_later_delta_reads_the_prompt_of_the_first(bundled_tokenizer) -> None:
    # Only a request's first delta carries the prompt. The prompt ends inside a character (the
    # first byte of an emoji's three tokens), so a sample's text depends on it.
    fox = bundled_tokenizer.encode("\N{FOX FACE}")
    assert len(fox) == 3
    prompt_ids = bundled_tokenizer.encode(PROMPT) + fox[:1]
    answer_ids = fox[1:] + bundled_tokenizer.encode(ANSWER)

    def sample_text(deltas: list[RequestOutput]) -> str:
        text = OutputText(bundled_tokenizer)
        text.add("r", SamplingParams(max_tokens=64, n=2))
        for out in deltas:
            assert text.apply(out) is False
        return "".join(c.text for out in deltas for c in out.outputs if c.index == 1)

    done = {0: "length", 1: "length"}
    together = sample_text([delta("r", prompt_ids, {0: answer_ids[:3], 1: answer_ids[:3]}),
                            delta("r", [], {0: answer_ids[3:], 1: answer_ids[3:]}, done, finished=True)])
    later = sample_text([delta("r", prompt_ids, {0: answer_ids[:3]}),
                         delta("r", [], {0: answer_ids[3:], 1: answer_ids}, done, finished=True)])
    assert together.endswith(ANSWER) and later == together


def test_forget_drops_an_aborted_request(bundled_tokenizer) -> None:
    text = OutputText(bundled_tokenizer)
    text.add("r", SamplingParams(max_tokens=8))
    text.forget("r")
    out = delta("r", bundled_tokenizer.encode(PROMPT), {0: [42]})
    assert text.apply(out) is False and out.outputs[0].text == ""
    assert len(text) == 0


def test_stop_strings_are_found_as_one_search_over_the_latest_text() -> None:
    """The stop string a piece completes: the leftmost, of those starting there the first listed
    (what a scan of each string in turn finds), searched for all strings at once in the last
    ``piece + longest - 1`` characters only (docs/server.md "Request limits")."""
    import random
    from dataclasses import dataclass

    from kvscale.server.engine.detokenizer import find_stop_string

    @dataclass
    class Sample:
        params: SamplingParams
        text: str = ""
        finish_reason: str | None = None
        stop_reason: str | int | None = None

    def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        return min(found)[::2] if found else None

    rng = random.Random(5)
    for _ in range(300):
        stops = ["".join(rng.choices("ab.", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        params = SamplingParams(stop=stops)
        sample = Sample(params)
        full = ""
        while sample.finish_reason is None and len(full) < 40:
            piece = "".join(rng.choices("abc.", k=rng.randint(1, 3)))
            full += piece
            sample.text += piece
            ended = find_stop_string(sample, len(piece))
            expected = first_stop(full, stops)
            assert ended == (expected is not None), (stops, full)
            if ended:
                assert expected is not None
                assert (sample.text, sample.stop_reason) == (full[:expected[0]], expected[1]), (stops, full)
        assert params.stop_matcher is params.stop_matcher  # built once per request
