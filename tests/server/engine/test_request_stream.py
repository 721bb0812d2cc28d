"""A request's stream on the event loop: what its reader gets, step by step, at a stream interval
(vLLM's ``--stream-interval``): the first token at once, then deltas of at least that many tokens,
the end at once, and every token exactly once."""

from __future__ import annotations

import asyncio

import pytest

from kvscale.server.engine.engine_front import EngineDeadError, RequestStream
from kvscale.server.outputs import CompletionOutput, RequestOutput


def delta(tokens: list[int], *, finished: bool = False, error: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, "".join(f"<{t}>" for t in tokens), list(tokens),
                                  finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [completion], finished, error=error)


def read_ready(stream: RequestStream) -> list[RequestOutput]:
    """Every output the reader would get now, without waiting for more steps."""

    async def drain() -> list[RequestOutput]:
        outputs = []
        while not stream._queue.empty():
            output = await stream.next()
            assert output is not None
            outputs.append(output)
        return outputs

    return asyncio.run(drain())


def steps(stream: RequestStream, per_step: list[list[int]], last_finishes: bool = True) -> list[list[int]]:
    """Put one delta per step, reading after each as a reader keeping up would; the token ids of
    each output the reader got."""
    got: list[list[int]] = []
    for i, tokens in enumerate(per_step):
        stream.put(delta(tokens, finished=last_finishes and i == len(per_step) - 1))
        got += [output.outputs[0].token_ids for output in read_ready(stream)]
    return got


def test_interval_one_wakes_the_reader_for_every_step() -> None:
    stream = RequestStream("r", 2)
    assert steps(stream, [[10], [11], [12], [13]]) == [[10], [11], [12], [13]]


def test_interval_holds_deltas_until_they_carry_enough_tokens() -> None:
    stream = RequestStream("r", 2, stream_interval=3)
    got = steps(stream, [[10], [11], [12], [13], [14], [15], [16], [17]])
    # The first token at once, then three at a time, the end (one token short of three) at once.
    assert got == [[10], [11, 12, 13], [14, 15, 16], [17]]
    assert [t for ids in got for t in ids] == list(range(10, 18))


def test_texts_are_joined_in_order_when_held() -> None:
    stream = RequestStream("r", 2, stream_interval=2)
    texts = []
    for i, tokens in enumerate([[1], [2], [3], [4]]):
        stream.put(delta(tokens, finished=i == 3))
        texts += [output.outputs[0].text for output in read_ready(stream)]
    assert texts == ["<1>", "<2><3>", "<4>"]


def test_a_step_of_several_tokens_counts_them_all() -> None:
    # Fast-forwarded grammar tokens come several to a step.
    stream = RequestStream("r", 2, stream_interval=4)
    got = steps(stream, [[1], [2, 3, 4, 5], [6], [7], [8]], last_finishes=False)
    assert got == [[1], [2, 3, 4, 5]]
    stream.put(delta([9], finished=True))
    assert [o.outputs[0].token_ids for o in read_ready(stream)] == [[6, 7, 8, 9]]


def test_outputs_before_the_first_token_pass_at_once() -> None:
    stream = RequestStream("r", 2, stream_interval=8)
    assert steps(stream, [[], [], [5], [6]], last_finishes=False) == [[], [], [5]]


def test_an_engine_refusal_passes_at_once() -> None:
    stream = RequestStream("r", 2, stream_interval=8)
    stream.put(delta([7]))
    stream.put(delta([], finished=True, error="grammar refused"))
    (output,) = read_ready(stream)
    assert output.error == "grammar refused" and output.finished


def test_an_abort_ends_the_stream_with_what_was_held_dropped_after_it() -> None:
    stream = RequestStream("r", 2, stream_interval=8)
    stream.put(delta([1]))
    stream.put(delta([2]))
    stream.put(None)

    async def read() -> list:
        return [await stream.next(), await stream.next()]

    first, end = asyncio.run(read())
    assert first.outputs[0].token_ids == [1, 2] and end is None


def test_engine_death_reaches_a_reader_with_held_deltas() -> None:
    stream = RequestStream("r", 2, stream_interval=8)
    stream.put(delta([1]))
    read_ready(stream)
    stream.put(delta([2]))
    stream.put(EngineDeadError("the engine stopped"))

    async def read() -> RequestOutput | None:
        output = await stream.next()
        assert output is not None and output.outputs[0].token_ids == [2]
        return await stream.next()

    with pytest.raises(EngineDeadError):
        asyncio.run(read())
