"""The OpenAI-compatible server end to end: a real `kvscale serve` process on loopback, the official
`openai` client, the bundled model. One server for the whole module (model load is the slow part).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from schemathesis import GenerationMode

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[2]))
from api_helpers import ServeProcess, scrape, wait_for_idle_pool  # noqa: E402
from openapi_fuzz import fuzz  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_BLOCKS = 48  # small on purpose: 64 concurrent requests must queue, preempt and free blocks
MAX_MODEL_LEN = 256
LONG_PROMPT = (
    "In a small village by the sea there lived an old fisherman who every morning pushed his boat "
    "into the waves, counted the gulls, and told his grandchildren the names of all the winds that "
    "ever crossed the bay. One day"
)


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "16",
        "--served-model-name", "smollm2", "smollm2-alias",
        "--dtype", "float32",  # the tests compare logprobs with transformers in float32
        log_name="api",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, prompt, max_tokens: int = 8, *, ignore_eos: bool = False, **kwargs):
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": ignore_eos}, **kwargs)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------------- the happy paths


def test_models_list(client) -> None:
    ids = [model.id for model in client.models.list().data]
    assert ids == ["smollm2", "smollm2-alias"]


def test_completion(client) -> None:
    result = greedy(client, "The capital of France is", max_tokens=6)
    (choice,) = result.choices
    assert result.object == "text_completion" and result.model == "smollm2"
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert result.usage.prompt_tokens == 5
    assert 1 <= result.usage.completion_tokens <= 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_alias_serves_the_same_model(client) -> None:
    result = client.completions.create(model="smollm2-alias", prompt="Hi", max_tokens=2, temperature=0)
    assert result.model == "smollm2-alias" and result.choices[0].text


def test_chat(client) -> None:
    result = client.chat.completions.create(
        model="smollm2", max_completion_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "What color is the sky?"},
                  {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "And grass?"}],
    )
    (choice,) = result.choices
    assert result.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert result.usage.completion_tokens <= 8


def test_stream_completion_matches_non_streaming(client) -> None:
    reference = greedy(client, "Once upon a time", max_tokens=10, ignore_eos=True)
    chunks = list(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks) == reference.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def tokens_per_event(client, **extra) -> tuple[list[int], str]:
    """Tokens each text-carrying event of a greedy 17-token stream holds, and the whole text."""
    chunks = list(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=17,
                                            temperature=0, stream=True, logprobs=1,
                                            extra_body={"ignore_eos": True, **extra}))
    counts = [len(chunk.choices[0].logprobs.tokens) for chunk in chunks if chunk.choices[0].logprobs]
    return counts, "".join(chunk.choices[0].text for chunk in chunks)


def test_a_request_stream_interval_groups_tokens_after_the_first(client) -> None:
    every, text = tokens_per_event(client)
    assert sum(every) == 17 and len(every) > 5  # a reader a step behind gets two steps in one event
    grouped, grouped_text = tokens_per_event(client, stream_interval=5)
    # The first token at once, then at least five per event; the end goes out as it comes.
    assert all(count >= 5 for count in grouped[1:-1]) and sum(grouped) == 17
    assert len(grouped) <= 1 + 4 and grouped_text == text


def test_a_stream_interval_below_one_is_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        tokens_per_event(client, stream_interval=0)
    assert error_of(refused.value)["param"] == "stream_interval"


def test_stream_with_usage_ends_with_a_usage_chunk(client) -> None:
    chunks = list(client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 7
    assert last.usage.prompt_tokens == 4 and last.usage.total_tokens == 11
    assert all(chunk.usage is None for chunk in content)


def test_stream_chat(client) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    reference = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reference.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == reference.choices[0].finish_reason


def test_sse_wire_format_ends_with_done(server) -> None:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, json={
        "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True,
    }) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_n_equals_two(client) -> None:
    result = client.completions.create(model="smollm2", prompt="My favourite animal is", n=2,
                                       max_tokens=6, temperature=1.0, seed=3)
    assert sorted(choice.index for choice in result.choices) == [0, 1]
    assert all(choice.text for choice in result.choices)
    chat = client.chat.completions.create(model="smollm2", n=2, max_tokens=4, temperature=1.0, seed=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert sorted(choice.index for choice in chat.choices) == [0, 1]
    assert 2 <= chat.usage.completion_tokens <= 8


def test_completion_logprobs(client) -> None:
    result = greedy(client, "The capital of France is", max_tokens=5, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()))
        assert logprob == pytest.approx(top[token])
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client) -> None:
    result = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert entry.bytes == list(entry.token.encode())


def test_stop_string(client) -> None:
    full = greedy(client, LONG_PROMPT, max_tokens=16, ignore_eos=True).choices[0].text
    stop = full[6:9]
    cut = full.index(stop)
    result = greedy(client, LONG_PROMPT, max_tokens=16, stop=[stop])
    (choice,) = result.choices
    assert choice.text == full[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_seed_reproducibility(client) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="smollm2", prompt="A list of colors:", max_tokens=12,
                                         temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
                                         ).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1


def test_token_id_prompts(client, server) -> None:
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    by_text = greedy(client, "The capital of France is", max_tokens=5).choices[0].text
    by_ids = greedy(client, ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = greedy(client, [ids, ids[:3]], max_tokens=3)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_list_of_string_prompts(client) -> None:
    result = greedy(client, ["The capital of France is", "Two plus two is"], max_tokens=3)
    assert [choice.index for choice in result.choices] == [0, 1]
    assert result.choices[0].text == greedy(client, "The capital of France is", max_tokens=3).choices[0].text


def test_a_requests_prompts_share_its_logit_bias_and_stop_in_the_core(client, server) -> None:
    """The request-wide fields reach the core once per request (engine_core_wire.py) and hold
    for every prompt."""
    token = httpx.post(f"{server.base_url}/tokenize", json={"prompt": " hello"}).json()["tokens"][-1]
    result = greedy(client, ["The capital of France is", "Two plus two is", "x"], max_tokens=6,
                    logit_bias={str(token): 100}, stop=["lo h"])
    assert [(c.text, c.finish_reason) for c in result.choices] == [(" hel", "stop")] * 3


def test_echo(client) -> None:
    result = greedy(client, "The capital of France is", max_tokens=4, echo=True)
    plain = greedy(client, "The capital of France is", max_tokens=4)
    assert result.choices[0].text == "The capital of France is" + plain.choices[0].text
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is",
                                            max_tokens=4, temperature=0, echo=True, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == result.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, bundled_tokenizer, hf_bundled_model) -> None:
    """echo + logprobs returns the prompt's tokens and logprobs too (how scoring harnesses use it)."""
    import torch

    prompt = "The capital of France is Paris, and the capital of Italy is"
    result = greedy(client, prompt, max_tokens=3, echo=True, logprobs=2)
    logprobs = result.choices[0].logprobs
    prompt_ids = bundled_tokenizer.encode(prompt)
    num_prompt = len(prompt_ids)
    assert result.usage.prompt_tokens == num_prompt
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[:num_prompt]) == prompt
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert logprobs.text_offset[num_prompt] == len(prompt)  # generated text starts after the echo
    with torch.inference_mode():
        reference = torch.log_softmax(hf_bundled_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    for j in range(1, num_prompt):
        assert logprobs.token_logprobs[j] == pytest.approx(float(reference[j - 1, prompt_ids[j]]), abs=2e-3)
        assert 1 <= len(logprobs.top_logprobs[j]) <= 3
    # The generated part is what a plain request with logprobs returns.
    plain = greedy(client, prompt, max_tokens=3, logprobs=2).choices[0].logprobs
    assert logprobs.tokens[num_prompt:] == plain.tokens
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.token_logprobs, abs=1e-4)
    # Streaming: the first chunk carries the echoed prompt and its logprobs.
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0,
                                            echo=True, logprobs=2, stream=True))
    streamed = [token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for token in chunk.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens
    assert chunks[0].choices[0].logprobs.text_offset[:num_prompt] == logprobs.text_offset[:num_prompt]


def test_cached_tokens_on_repeated_prefix(client) -> None:
    prompt = LONG_PROMPT + " the sea was flat"
    first = greedy(client, prompt, max_tokens=2)
    second = greedy(client, prompt, max_tokens=2)
    full_blocks = (second.usage.prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
    assert second.usage.prompt_tokens >= 2 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens < full_blocks
    assert second.usage.prompt_tokens_details.cached_tokens >= full_blocks - BLOCK_SIZE
    assert second.usage.prompt_tokens_details.cached_tokens % BLOCK_SIZE == 0
    assert second.choices[0].text == first.choices[0].text
    chat_messages = [{"role": "user", "content": LONG_PROMPT}]
    client.chat.completions.create(model="smollm2", messages=chat_messages, max_tokens=1)
    chat = client.chat.completions.create(model="smollm2", messages=chat_messages, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE


def test_tokenize_detokenize_version_health(server) -> None:
    base = server.base_url
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = httpx.post(f"{base}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n")
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/version").json()["version"]


def test_metrics_exposes_vllm_and_kvscale_names(server, client) -> None:
    greedy(client, "Hello", max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
        "kvscale:kv_blocks_total", "kvscale:kv_blocks_active", "kvscale:kv_blocks_cached",
        "kvscale:max_num_seqs",
    ):
        assert f'{name}{{' in text, name
    samples = scrape(server.base_url)
    assert samples["kvscale:kv_blocks_total"] == NUM_BLOCKS
    assert samples["kvscale:max_num_seqs"] == 16  # the autoscaler's batch slots (--max-num-seqs)
    assert samples["vllm:request_success_total{finished_reason=length}"] >= 1
    assert 'model_name="smollm2"' in text


# ---------------------------------------------------------------------------- errors


def test_invalid_parameter_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="x", temperature=-1)
    error = error_of(info.value)
    assert error["type"] == "invalid_request_error" and error["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="x", max_tokens=4, extra_body={"min_tokens": 5})
    assert "min_tokens" in error_of(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert error_of(info.value)["param"] == "top_logprobs"


def test_malformed_json_is_400(server) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "x", ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"[1, 2]",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()


def test_prompt_beyond_max_model_len_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=LONG_PROMPT * 8, max_tokens=4)
    assert "maximum context length is 256" in error_of(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=MAX_MODEL_LEN)
    assert "maximum context length" in error_of(info.value)["message"]


def test_bad_prompts_are_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=[10**6], max_tokens=2)
    assert "vocabulary" in error_of(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="", max_tokens=2)
    assert "empty" in error_of(info.value)["message"]


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    error = error_of(info.value)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-17" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_has_error_body(server) -> None:
    response = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["message"]


# ---------------------------------------------------------------------------- aborts and churn


def test_non_streaming_disconnect_frees_blocks(server) -> None:
    # The client leaves after about half the time 200 tokens take on this machine (timed here, not
    # assumed: a fast machine writes 200 tokens within a fixed second and a half).
    body = {"prompt": LONG_PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    started = time.perf_counter()
    assert httpx.post(f"{server.base_url}/v1/completions", timeout=60, json=body).status_code == 200
    leave_after_s = min(1.5, max(0.2, (time.perf_counter() - started) * 5))
    before = scrape(server.base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", timeout=leave_after_s, json={
            "prompt": LONG_PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
        })
    after = wait_for_idle_pool(server.base_url, timeout_s=10)
    assert after["kvscale:kv_blocks_active"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["vllm:request_success_total{finished_reason=abort}"] == (
        before["vllm:request_success_total{finished_reason=abort}"] + 1
    )
    # Aborted well before 200 tokens were generated.
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200


def test_churn_with_disconnects_returns_pool_to_free(server, client) -> None:
    prompts = [f"Story {i}: {LONG_PROMPT[: 40 + 20 * i]}" for i in range(4)]
    max_tokens = 12
    references = [greedy(client, prompt, max_tokens=max_tokens, ignore_eos=True).choices[0].text
                  for prompt in prompts]
    rng = random.Random(7)
    leavers = set(rng.sample(range(64), 64 // 3))
    before = scrape(server.base_url)

    async def one(i: int, aclient: openai.AsyncOpenAI) -> str | None:
        stream = await aclient.completions.create(
            model="smollm2", prompt=prompts[i % 4], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if i in leavers and len(text) > 0:
                await stream.close()  # the client walks away mid-stream
                return None
        return text

    async def run_all() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(i, aclient) for i in range(64)))

    results = asyncio.run(run_all())
    for i, text in enumerate(results):
        if i in leavers:
            assert text is None
        else:
            assert text == references[i % 4], f"request {i} came back wrong"
    after = wait_for_idle_pool(server.base_url, timeout_s=30)
    assert after["kvscale:kv_blocks_active"] == 0
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    finished = after["vllm:request_success_total{finished_reason=length}"] - before[
        "vllm:request_success_total{finished_reason=length}"]
    aborted = after["vllm:request_success_total{finished_reason=abort}"] - before[
        "vllm:request_success_total{finished_reason=abort}"]
    # Every request ends exactly once; a leaver whose last token was already out may have
    # finished before its abort arrived.
    assert finished + aborted == 64
    assert finished >= 64 - len(leavers)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---------------------------------------------------------------------------- schemathesis


def test_openapi_fuzz_has_no_server_errors(server) -> None:
    """schemathesis generates valid and invalid requests for every operation in /openapi.json."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz(operation, GenerationMode.POSITIVE, server.base_url, calls)
        # Only the POST operations take input, so only they have invalid input to generate.
        if operation.method.upper() == "POST":
            fuzz(operation, GenerationMode.NEGATIVE, server.base_url, calls)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= set(calls)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_body_with_nan_is_400_malformed_json_even_inside_a_schema(server) -> None:
    """Python's json reads NaN; JSON has none, and inside a schema it would become a constraint."""
    body = (b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, '
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": NaN}}}}')
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Malformed JSON body")
