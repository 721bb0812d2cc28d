"""Beam search, offline (``LLM.beam_search``) and over HTTP (``use_beam_search`` on
/v1/completions), against transformers' ``generate(num_beams=...)`` on a tiny random-weight Llama
in float32 (server/engine/beam_search.py follows transformers' rule), and what the API refuses.

The EOS row of the LM head is scaled up so that EOS ranks high in some contexts and hypotheses
end at different lengths, which is where ``length_penalty`` and early stopping matter. Beams
and scores are compared whole: every returned beam's tokens and its normalized score. Equality
holds as long as no two candidates tie in cumulative logprob (transformers' ``topk`` breaks
ties its own way); random float32 weights make a tie vanishingly unlikely.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import serve_app_in_thread  # noqa: E402
from thread_engine import ThreadEngine  # noqa: E402
from tiny_checkpoints import TOKENIZER_FILES, copy_tokenizer, write_tiny_llama  # noqa: E402

from bench.beam_search import beam_params, generated_beams, hf_beams
from kvscale.model_files import load_tokenizer
from kvscale.server.config import EngineConfig
from kvscale.server.engine.beam_search import BeamSearchParams
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.entrypoints.api_server import build_app
from kvscale.server.entrypoints.llm import LLM

VOCAB, EOS = 49152, 2  # the bundled tokenizer's: chat templates render within it
PROMPTS = [[5, 17, 42, 99, 7, 300, 11], [250, 3, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def make_tiny_llama(path: Path, bundled_model_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy_tokenizer(bundled_model_path, path, (*TOKENIZER_FILES, "chat_template.jinja"))
    write_tiny_llama(path, vocab=VOCAB, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     max_position_embeddings=256, norm_jitter=0.1)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][EOS] *= 6.0
    save_file(weights, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny(bundled_model_path, tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_beam")
    make_tiny_llama(path, bundled_model_path)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=256)
    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return llm, hf, path


API_ENGINE: list[LLMEngine] = []  # the api fixture's engine, for the disconnect test


@pytest.fixture(scope="module")
def api(tiny: tuple[LLM, Any, Path]) -> Iterator[str]:
    """``kvscale serve``'s app over an engine on a thread of this process (the tiny checkpoint)."""
    path = tiny[2]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=4,
                                    num_gpu_blocks_override=256))
    app = build_app(ThreadEngine(engine), tokenizer=load_tokenizer(engine.model_path), served_model_names=["tiny"],
                    max_model_len=engine.max_model_len, vocab_size=VOCAB, model_root=str(path))
    server, thread, url = serve_app_in_thread(app)
    API_ENGINE.append(engine)
    yield url
    API_ENGINE.clear()
    server.should_exit = True
    thread.join(30)


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty", "early_stopping"), [
    (3, 10, 0.5, False), (2, 6, 2.0, True), (4, 7, 1.5, "never"),
])
def test_beams_equal_transformers(tiny, width, max_tokens, length_penalty, early_stopping):
    llm, hf, _ = tiny
    params = beam_params(width, max_tokens, length_penalty, early_stopping)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_beams(hf, prompt, width, max_tokens, length_penalty, early_stopping, EOS)
        got = generated_beams(output, len(prompt))
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        assert [score for _, score in got] == pytest.approx([score for _, score in expected], abs=1e-4)
        for seq in output.sequences:
            assert seq.cum_logprob == pytest.approx(sum(seq.logprobs))


def test_some_beams_end_on_eos_and_beams_share_blocks(tiny):
    llm, _, _ = tiny
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    before = llm.llm_engine.get_stats()
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    after = llm.llm_engine.get_stats()
    # Each step's requests read the prompt's and their parent beam's full blocks from the cache.
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    assert after.prefix_cache_hits - before.prefix_cache_hits > queried // 2
    reasons = {seq.finish_reason for output in outputs for seq in output.sequences}
    assert reasons == {"stop", "length"}, "the checkpoint should end some beams on EOS"
    for output in outputs:
        for seq in output.sequences:
            assert seq.tokens[-1] != EOS  # the EOS left out without include_stop_str_in_output


def test_beam_search_refusals(tiny):
    llm, _, _ = tiny
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=10_000))


def test_completions_return_the_n_best_beams(tiny, api):
    _, hf, path = tiny
    tokenizer = load_tokenizer(path)
    body = {"model": "tiny", "prompt": PROMPTS[:2], "n": 3, "max_tokens": 8, "use_beam_search": True,
            "length_penalty": 0.5}
    response = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for index, prompt in enumerate(PROMPTS[:2]):
        expected = hf_beams(hf, prompt, 3, 8, 0.5, False, EOS)
        got = choices[index * 3:index * 3 + 3]
        assert [c["text"] for c in got] == [tokenizer.decode([t for t in tokens if t != EOS], skip_special_tokens=True)
                                            for tokens, _ in expected]
        assert [c["finish_reason"] for c in got] == ["stop" if tokens[-1] == EOS else "length"
                                                     for tokens, _ in expected]
        assert all(c["stop_reason"] is None for c in got)  # EOS is no stop token
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])


def test_stop_strings_end_beams(api):
    def beams(n: int, stop: list[str] | None = None) -> list[dict]:
        return httpx.post(f"{api}/v1/completions", json={
            "prompt": PROMPTS[0], "n": n, "max_tokens": 6, "use_beam_search": True, "ignore_eos": True,
            "stop": stop}, timeout=60).json()["choices"]

    plain = beams(1)[0]
    assert plain["finish_reason"] == "length"
    stop = plain["text"][2:4]
    # One beam follows the greedy path, which now ends at the stop string (left out of the text).
    (stopped,) = beams(1, [stop])
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert stopped["text"] == plain["text"][:2]
    for choice in beams(3, [stop]):
        assert stop not in choice["text"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 11}, "n"), ({"temperature": 0.7}, "temperature"), ({"min_tokens": 2}, "min_tokens"),
    ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"), ({"echo": True}, "echo"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ({"length_penalty": "long"}, "length_penalty"),
])
def test_refused_with_beam_search(api, extra, param):
    body = {"prompt": PROMPTS[0], "n": 2, "max_tokens": 4, "use_beam_search": True, **extra}
    response = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_returns_the_n_best_beams_of_the_rendered_conversation(api):
    messages = [{"role": "user", "content": "a b"}]
    chat = httpx.post(f"{api}/v1/chat/completions", json={
        "messages": messages, "max_tokens": 5, "n": 2, "use_beam_search": True}, timeout=60)
    assert chat.status_code == 200, chat.text
    ids = httpx.post(f"{api}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    completion = httpx.post(f"{api}/v1/completions", json={
        "prompt": ids, "max_tokens": 5, "n": 2, "use_beam_search": True}, timeout=60).json()
    assert [c["message"]["content"] for c in chat.json()["choices"]] == [c["text"] for c in completion["choices"]]
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]
    for extra, param in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),):
        response = httpx.post(f"{api}/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "use_beam_search": True, **extra}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_neutral_values_pass(api):
    response = httpx.post(f"{api}/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0,
        "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text


def test_a_client_that_leaves_ends_the_search(api):
    body = json.dumps({"prompt": PROMPTS[2], "n": 4, "max_tokens": 200, "use_beam_search": True,
                       "ignore_eos": True}).encode()
    engine = API_ENGINE[0]
    begun = time.monotonic()
    assert httpx.post(f"{api}/v1/completions", content=body, timeout=300,
                      headers={"content-type": "application/json"}).status_code == 200
    whole_search_s = time.monotonic() - begun
    host, port = api.removeprefix("http://").split(":")
    # The client leaves once the search runs, whatever this machine's speed (a fixed client timeout
    # outlived the whole search on a fast CPU).
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        started = time.monotonic() + 10
        while not engine.has_unfinished_requests():
            assert time.monotonic() < started, "the search never started"
            time.sleep(0.002)
    left = time.monotonic()
    # The step's requests are aborted and no further step is added: the search ends well before
    # the whole search would have.
    while engine.has_unfinished_requests():
        assert time.monotonic() - left < whole_search_s / 2, "the search went on after the client left"
        time.sleep(0.005)
    # A search still going would hold requests nearly all the time (steps follow back to back).
    busy = 0
    for _ in range(20):
        time.sleep(0.02)
        busy += engine.has_unfinished_requests()
    assert busy == 0


def sse_chunks(response: httpx.Response) -> list[dict]:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(event) for event in events[:-1]]


def test_streamed_tool_calls_carry_their_tokens_logprobs(api):
    """Sampling with a forced tool call, on the same app: every streamed chunk that carries tokens
    carries their logprobs, tool-call deltas too, and together they are the whole answer's."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
        "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 24, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "logprobs": True, "top_logprobs": 2,
            "temperature": 0}
    whole = httpx.post(f"{api}/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    (choice,) = whole.json()["choices"]
    assert choice["message"]["tool_calls"] or choice["finish_reason"] == "length", choice
    expected = choice["logprobs"]["content"]
    assert len(expected) == whole.json()["usage"]["completion_tokens"]
    streamed = httpx.post(f"{api}/v1/chat/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60)
    assert streamed.status_code == 200, streamed.text
    entries = []
    tool_deltas = 0
    for chunk in sse_chunks(streamed)[1:]:  # after the role chunk
        for streamed_choice in chunk["choices"]:
            delta = streamed_choice["delta"]
            tool_deltas += bool(delta.get("tool_calls"))
            if delta.get("tool_calls") or delta.get("content"):
                assert streamed_choice["logprobs"] is not None, chunk
            if streamed_choice["logprobs"] is not None:
                entries += streamed_choice["logprobs"]["content"]
    assert tool_deltas > 0
    assert [e["token"] for e in entries] == [e["token"] for e in expected]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == [
        [t["token"] for t in e["top_logprobs"]] for e in expected]
    assert any(e["top_logprobs"] for e in entries)


@pytest.mark.parametrize("top", [2, 5])  # within the 2n candidates each step asks for, and beyond
def test_beams_answer_their_tokens_logprobs(tiny, api, top):
    """Each beam's logprobs are its own tokens' (the stop token too), and they add up to its score."""
    _, hf, _ = tiny
    body = {"prompt": PROMPTS[0], "n": 2, "max_tokens": 6, "use_beam_search": True, "length_penalty": 0.5,
            "logprobs": top}
    response = httpx.post(f"{api}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    expected = hf_beams(hf, PROMPTS[0], 2, 6, 0.5, False, EOS)
    for choice, (tokens, score) in zip(choices, expected, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(tokens)
        assert sum(logprobs["token_logprobs"]) / len(tokens) ** 0.5 == pytest.approx(score, abs=1e-4)
        assert all(len(t) >= top for t in logprobs["top_logprobs"])
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert response.json()["usage"]["completion_tokens"] == sum(len(t) for t, _ in expected)
    chat = httpx.post(f"{api}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a b"}], "max_tokens": 4, "n": 2, "use_beam_search": True,
        "logprobs": True, "top_logprobs": top}, timeout=60)
    assert chat.status_code == 200, chat.text
    for choice in chat.json()["choices"]:
        content = choice["logprobs"]["content"]
        assert content and all(len(entry["top_logprobs"]) == top for entry in content)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_streamed_beam_search_sends_the_final_beams_at_the_end(api, endpoint):
    """As vLLM's chat does: the beams are known when the search ends, so each choice comes whole
    in one chunk (after chat's role chunk), then usage and [DONE]."""
    chat = endpoint == "chat/completions"
    body: dict[str, Any] = {"n": 3, "max_tokens": 5, "use_beam_search": True, "logprobs": True if chat else 1}
    body.update({"messages": [{"role": "user", "content": "a b"}], "top_logprobs": 1} if chat
                else {"prompt": PROMPTS[1]})
    whole = httpx.post(f"{api}/v1/{endpoint}", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    streamed = httpx.post(f"{api}/v1/{endpoint}", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}, timeout=60)
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(streamed)
    if chat:
        assert [c["delta"] for c in chunks[0]["choices"]] == [{"role": "assistant", "content": ""}] * 3
        chunks = chunks[1:]
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == whole.json()["usage"]
    choices = [choice for chunk in choice_chunks for choice in chunk["choices"]]
    assert all(chunk["object"] == ("chat.completion.chunk" if chat else "text_completion") for chunk in chunks)
    for got, want in zip(choices, whole.json()["choices"], strict=True):
        text = got["delta"]["content"] if chat else got["text"]
        assert text == (want["message"]["content"] if chat else want["text"])
        assert (got["index"], got["logprobs"], got["finish_reason"]) == (
            want["index"], want["logprobs"], want["finish_reason"])
