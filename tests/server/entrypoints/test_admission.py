"""A request is validated once, at the edge, with one message per failure.

The edges are the HTTP API and the offline `LLM`; both must say the same thing about the same bad
request, and the engine behind them only asserts what they already checked.
"""

from __future__ import annotations

import pytest

from kvscale import LLM, SamplingParams
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving import APIError, OpenAIServer
from kvscale.server.entrypoints.serving_completions import prepare_completion

MAX_MODEL_LEN = 64
VOCAB = 49152

# (prompt ids, max_tokens) -> the one message the client gets, wherever it asked.
BAD_REQUESTS = {
    "empty prompt": ([], 4, "The prompt is empty."),
    "id beyond the vocabulary": ([1, VOCAB + 7], 4, f"Token id {VOCAB + 7} is out of vocabulary (size {VOCAB})."),
    "prompt fills the context": (
        list(range(1, MAX_MODEL_LEN + 1)), 4,
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt has "
        f"{MAX_MODEL_LEN} tokens, leaving no room for completion tokens. Please reduce the length of the prompt.",
    ),
    "prompt and max_tokens beyond the context": (
        list(range(1, 61)), 10,
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 70 tokens "
        "(60 in the prompt, 10 for the completion). Please reduce the length of the prompt or max_tokens.",
    ),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", num_gpu_blocks_override=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def http_edge(llm) -> OpenAIServer:
    engine = llm.llm_engine
    return OpenAIServer(None, tokenizer=engine.tokenizer, served_model_names=["m"],  # type: ignore[arg-type]
                        max_model_len=engine.max_model_len)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_both_edges_give_the_same_single_message(case: str, llm, http_edge) -> None:
    ids, max_tokens, message = BAD_REQUESTS[case]
    body = p.CompletionRequest.model_construct(**{**p.CompletionRequest(prompt=[1]).model_dump(),
                                                  "prompt": ids, "max_tokens": max_tokens})
    with pytest.raises(APIError) as http_error:
        prepare_completion(http_edge, body)
    assert http_error.value.status == 400
    assert http_error.value.message == message

    with pytest.raises(ValueError) as offline_error:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens))
    assert str(offline_error.value) == message
    assert not llm.llm_engine.has_unfinished_requests()


def test_offline_string_prompt_is_checked_like_ids(llm) -> None:
    with pytest.raises(ValueError) as error:
        llm.generate("", SamplingParams(max_tokens=4))
    assert str(error.value) == BAD_REQUESTS["empty prompt"][2]
    with pytest.raises(ValueError) as error:
        llm.generate("word " * 80, SamplingParams(max_tokens=4))
    assert str(error.value).startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")


def test_the_engine_asserts_what_the_edges_checked(llm) -> None:
    """Behind the edges nothing unchecked arrives; the engine's checks are assertions, not a
    second set of user-facing messages."""
    engine = llm.llm_engine
    with pytest.raises(AssertionError):
        engine.add_request("unchecked-empty", [], SamplingParams(max_tokens=4))
    with pytest.raises(AssertionError):
        engine.add_request("unchecked-vocab", [VOCAB + 7], SamplingParams(max_tokens=4))
    with pytest.raises(AssertionError):
        engine.add_request("unchecked-long", list(range(1, 61)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()
