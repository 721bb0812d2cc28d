"""Request validation and request -> engine mapping of the HTTP server (pure functions, no engine)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.admission import resolve_max_tokens
from kvscale.server.entrypoints.serving import sampling_params_from
from kvscale.server.entrypoints.serving_chat import chat_logprobs
from kvscale.server.entrypoints.serving_completions import completion_logprobs, completion_prompts
from kvscale.server.outputs import Logprob
from kvscale.tokenization import chat_prompt_token_ids, completion_prompt_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def test_max_tokens_defaults_to_what_fits() -> None:
    assert resolve_max_tokens(None, 10, 64) == 54
    assert resolve_max_tokens(20, 10, 64) == 20
    assert resolve_max_tokens(54, 10, 64) == 54


@pytest.mark.parametrize(("requested", "prompt_len"), [(55, 10), (None, 64), (1, 64), (None, 100)])
def test_max_tokens_beyond_context_is_rejected(requested: int | None, prompt_len: int) -> None:
    with pytest.raises(ValueError, match="maximum context length is 64"):
        resolve_max_tokens(requested, prompt_len, 64)


def test_sampling_params_take_openai_defaults() -> None:
    request = p.CompletionRequest(prompt="hi")
    params = sampling_params_from(request, max_tokens=16, logprobs=None)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, -1, 0.0)
    assert params.stop == [] and params.seed is None and params.n == 1 and params.max_tokens == 16


def test_sampling_params_carry_every_field() -> None:
    request = p.CompletionRequest(
        prompt="hi", n=3, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, stop="\n",
        stop_token_ids=[2], min_tokens=2, ignore_eos=True, include_stop_str_in_output=True,
    )
    params = sampling_params_from(request, max_tokens=8, logprobs=3)
    assert params.n == 3 and params.temperature == 0.5 and params.top_p == 0.9 and params.top_k == 40
    assert params.min_p == 0.05 and params.seed == 7 and params.repetition_penalty == 1.1
    assert params.presence_penalty == 0.5 and params.frequency_penalty == -0.5
    assert params.stop == ["\n"] and params.stop_token_ids == [2] and params.min_tokens == 2
    assert params.ignore_eos and params.include_stop_str_in_output and params.logprobs == 3
    assert params.max_tokens == 8


def test_min_tokens_above_max_tokens_is_a_value_error() -> None:
    request = p.CompletionRequest(prompt="hi", min_tokens=9)
    with pytest.raises(ValueError, match="min_tokens"):
        sampling_params_from(request, max_tokens=8, logprobs=None)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "seed": 2**64},
        {"prompt": "x", "temperature": math.nan},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [-1]},
        {"prompt": 5},
        {},
        {"prompt": "x", "cache_salt": ""},
    ],
)
def test_invalid_completion_bodies_fail_validation(body: dict) -> None:
    with pytest.raises(ValidationError):
        p.CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    ],
)
def test_invalid_chat_bodies_fail_validation(body: dict) -> None:
    with pytest.raises(ValidationError):
        p.ChatCompletionRequest.model_validate(body)


def test_prompt_forms_become_one_prompt_each() -> None:
    assert completion_prompts("a") == ["a"]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    parsed = p.CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompt
    assert completion_prompts(parsed) == [[1, 2], [3]]


def test_chat_content_parts_are_joined() -> None:
    message = p.ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert message.text() == "ab"


def test_error_body_has_openai_shape() -> None:
    assert p.error_body("nope", "invalid_request_error", param="n") == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "n", "code": None}
    }


def _position(chosen: int, alternatives: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])
    return {tid: Logprob(lp, rank, f"<{tid}>") for rank, (tid, lp) in enumerate(ranked, start=1)} | (
        {} if chosen in alternatives else {chosen: Logprob(-9.0, 99, f"<{chosen}>")}
    )


def test_completion_logprobs_shape() -> None:
    positions = [_position(5, {5: -0.1, 6: -2.0, 7: -3.0}), _position(8, {9: -0.2, 6: -1.0})]
    result = completion_logprobs([5, 8], positions, 2, text_offset=3, decode=lambda t: f"<{t}>")
    assert result.tokens == ["<5>", "<8>"]
    assert result.token_logprobs == [-0.1, -9.0]
    assert result.top_logprobs[0] == {"<5>": -0.1, "<6>": -2.0}
    # The chosen token is always listed, even when it is not among the top ones.
    assert result.top_logprobs[1] == {"<9>": -0.2, "<6>": -1.0, "<8>": -9.0}
    assert result.text_offset == [3, 6]


def test_chat_logprobs_shape() -> None:
    positions = [_position(5, {5: -0.1, 6: -2.0, 7: -3.0})]
    result = chat_logprobs([5], positions, 1, decode=lambda t: f"<{t}>")
    (entry,) = result.content
    assert entry.token == "<5>" and entry.logprob == -0.1 and entry.bytes == list(b"<5>")
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("<5>", -0.1)]


def test_tokenization_contract(tokenizer) -> None:
    """The router hashes blocks of exactly these ids; pin them so a change is noticed."""
    ids = completion_prompt_token_ids(tokenizer, "The capital of France is")
    assert ids == tokenizer("The capital of France is")["input_ids"]
    assert completion_prompt_token_ids(tokenizer, ids) == ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat_ids = chat_prompt_token_ids(tokenizer, messages)
    text = tokenizer.decode(chat_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert text.count("<|im_start|>") == 3  # no extra BOS added on top of the template's


def test_serve_help_lists_vllm_flags() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kvscale", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    for flag in ("--model", "--served-model-name", "--host", "--port", "--api-key", "--dtype",
                 "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--gpu-memory-utilization", "--num-gpu-blocks-override", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--max-queue-len", "--redis", "--replica-id"):
        assert flag in result.stdout, flag


def test_serve_rejects_bad_engine_flags_readably() -> None:
    from kvscale.cli import main

    assert main(["serve", "--block-size", "0"]) == 2
    assert main(["serve", "--max-queue-len", "-1"]) == 2


def test_serve_defaults(monkeypatch) -> None:
    from kvscale.cli import build_parser

    monkeypatch.setenv("KVSCALE_API_KEY", "from-env")
    args = build_parser("serve").parse_args(["serve"])
    assert args.port == 8000 and args.api_key == "from-env" and args.enable_prefix_caching is None
    args = build_parser("serve").parse_args(["serve", "--no-enable-prefix-caching", "--api-key", "k"])
    assert args.enable_prefix_caching is False and args.api_key == "k"


def test_shutdown_timeout_flags_fit_the_pod_grace_period() -> None:
    """The operator gives pods 60 s; both processes drain for 45 s by default (room for a preStop
    sleep and the shutdown itself), and the flag is what uvicorn's graceful timeout follows."""
    from kvscale.cli import build_parser
    from kvscale.drain import DEFAULT_SHUTDOWN_TIMEOUT_S

    assert DEFAULT_SHUTDOWN_TIMEOUT_S == 45
    assert build_parser("serve").parse_args(["serve"]).shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S
    assert build_parser("serve").parse_args(["serve", "--shutdown-timeout", "20"]).shutdown_timeout == 20
    router = build_parser("router").parse_args(["router", "--replicas", "http://x:1"])
    assert router.shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S


def test_a_client_that_leaves_while_its_grammar_compiles_aborts_its_request() -> None:
    """A streamed constrained request waits for its first output (the grammar) before the 200;
    a client that leaves meanwhile frees its request at once, not after the compile."""
    import asyncio

    from kvscale.server.entrypoints.serving import Prepared
    from kvscale.server.entrypoints.serving_streams import first_outputs_while_connected
    from kvscale.server.sampling_params import SamplingParams

    class Stream:
        def __init__(self) -> None:
            self.aborted = asyncio.Event()

        async def next(self):
            await self.aborted.wait()  # no output until the grammar compiles, or an abort
            return None

    class Server:
        def release(self, streams) -> None:
            for stream in streams:
                stream.aborted.set()

    class Request:
        def __init__(self) -> None:
            self.gone = asyncio.Event()

        async def receive(self) -> dict:
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def scenario() -> list:
        request, streams = Request(), [Stream()]
        prepared = Prepared("r", [[1]], [""], [SamplingParams()], None, "structured_outputs")
        waiting = asyncio.ensure_future(first_outputs_while_connected(request, Server(), streams, prepared))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        request.gone.set()
        return await asyncio.wait_for(waiting, 2)

    assert asyncio.run(scenario()) == [None]
