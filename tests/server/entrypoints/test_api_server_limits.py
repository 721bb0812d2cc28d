"""API keys, the queue limit and a dead engine loop: the server's refusals, each with its status
and OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess, free_port, scrape, wait_for_idle_pool  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "sk-kvscale-test-key"


@pytest.fixture(scope="module")
def guarded():
    """One sequence at a time and at most one waiting: the third concurrent request is refused."""
    proc = ServeProcess(
        "--max-model-len", "128", "--num-gpu-blocks-override", "32", "--max-num-seqs", "1",
        "--max-queue-len", "1", env={"KVSCALE_API_KEY": API_KEY}, log_name="guarded",
    )
    yield proc
    proc.stop()


def test_api_key_from_env_is_required(guarded) -> None:
    url = f"{guarded.base_url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401, headers
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="smollm2-135m-instruct", prompt="x", max_tokens=1)
    for path in ("/tokenize",):
        assert httpx.post(f"{guarded.base_url}{path}", json={"prompt": "x"}).status_code == 401
    right = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert right.completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=1).choices
    # Probes and scrapers need no key; the API's description is behind it like the API.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{guarded.base_url}{path}").status_code == 200, path
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{guarded.base_url}{path}").status_code == 401, path
        assert httpx.get(f"{guarded.base_url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}
                         ).status_code == 200, path


def test_the_key_is_checked_before_the_body_is_read(guarded) -> None:
    """A client without the key announces a 30 MiB body and sends none of it: the 401 comes at
    once, so no body is held for it (else it waits for the body, up to --request-body-timeout)."""
    port = int(guarded.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 31457280\r\n\r\n{")
        sock.settimeout(3)
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head


def test_full_queue_is_503_with_retry_after(guarded) -> None:
    base = guarded.base_url
    body = {"model": "smollm2-135m-instruct", "prompt": "Count: one, two,", "max_tokens": 100,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
            # A stream's 200 comes with its first token: the queued one's not before the other ends.
            def send() -> asyncio.Future[httpx.Response]:
                return asyncio.ensure_future(http.send(http.build_request("POST", "/v1/completions", json=body),
                                                       stream=True))

            async def one_in(gauge: str) -> None:
                deadline = time.monotonic() + 60
                while scrape(base).get(gauge) != 1:
                    assert time.monotonic() < deadline, f"no request in {gauge}"
                    await asyncio.sleep(0.2)

            opened = [send()]
            try:
                await one_in("vllm:num_requests_running")
                opened.append(send())
                await one_in("vllm:num_requests_waiting")
                refused = await http.post("/v1/completions", json={**body, "stream": False})
            finally:
                for task in opened:
                    task.cancel()  # a request still waiting for its 200: its connection closes
                for result in await asyncio.gather(*opened, return_exceptions=True):
                    if isinstance(result, httpx.Response):
                        await result.aclose()
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "server_error"
    # Closing both streams aborted them: nothing left running, no block held.
    idle = wait_for_idle_pool(base, timeout_s=20)
    assert idle["kvscale:kv_blocks_active"] == 0 and idle["vllm:num_requests_running"] == 0


def _request_timeout_stops_the_answer(engine, app, base: str) -> None:
    """--request-timeout: the client of a non-streamed answer sees nothing until it is whole, so
    the server bounds its wait: a 504 naming the flag, and its sequences stop at once (no block
    held after). Each step is slowed so the answer cannot be ready in time on any machine."""
    step = engine.step

    def slow_step():
        time.sleep(0.1)
        return step()

    engine.step = slow_step
    app.state.server.request_timeout_s = 1.0
    try:
        started = time.monotonic()
        response = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": ["One,", "Two,"], "max_tokens": 50, "ignore_eos": True})
        assert response.status_code == 504, response.text
        assert time.monotonic() - started < 4  # 1 s, not the 5 s the answer takes
        error = response.json()["error"]
        assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]
        idle = wait_for_idle_pool(base, timeout_s=20)
        assert idle["kvscale:kv_blocks_active"] == 0 and idle["vllm:num_requests_running"] == 0
    finally:
        engine.step = step
        app.state.server.request_timeout_s = None


def test_a_late_answer_is_a_504_and_a_dead_engine_loop_makes_health_503() -> None:
    """Over one in-process engine (one model load for both): an answer not ready within
    --request-timeout is a 504 that stops it; then the engine thread dies (a fault injected into
    a real engine's step): /health says 503 and requests get an OpenAI error body instead of
    hanging."""
    import uvicorn
    from thread_engine import ThreadEngine

    from kvscale.model_files import load_tokenizer
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.entrypoints.api_server import build_app

    engine = LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8, device="cpu"))
    thread_engine = ThreadEngine(engine)
    app = build_app(thread_engine, tokenizer=load_tokenizer(engine.model_path),
                    served_model_names=[engine.model_name], max_model_len=engine.max_model_len)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 8
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{base}/health").status_code == 200
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
        _request_timeout_stops_the_answer(engine, app, base)

        def broken_step():
            raise RuntimeError("injected fault")

        engine.step = broken_step
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        assert "injected fault" in response.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["error"]["message"]
        again = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_request_is_counted_by_its_sequences_not_as_one(guarded) -> None:
    """--max-queue-len 1: a request of two prompts, or of one prompt with n=2, would queue two
    sequences by itself; it can never fit, so it is a 400 that names the limit, not a 503."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = {"model": "smollm2-135m-instruct", "max_tokens": 1}
    for body in ({**base, "prompt": ["one", "two"]}, {**base, "prompt": "one", "n": 2}):
        response = httpx.post(f"{guarded.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "--max-queue-len 1" in error["message"]
    one = httpx.post(f"{guarded.base_url}/v1/completions", json={**base, "prompt": "one"},
                     headers=headers, timeout=60)
    assert one.status_code == 200, one.text


@pytest.fixture(scope="module")
def capped():
    """A server with a low cap on prompts per request and a server-wide stream interval."""
    proc = ServeProcess("--max-model-len", "128", "--num-gpu-blocks-override", "32",
                        "--max-prompts-per-request", "3", "--stream-interval", "4", log_name="capped")
    yield proc
    proc.stop()


def test_prompts_per_request_are_capped_before_tokenizing(capped) -> None:
    url = f"{capped.base_url}/v1/completions"
    body = {"model": "smollm2-135m-instruct", "max_tokens": 1}
    refused = httpx.post(url, json={**body, "prompt": ["x"] * 4}, timeout=30)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "--max-prompts-per-request" in error["message"]
    assert "4 prompts" in error["message"]
    fine = httpx.post(url, json={**body, "prompt": ["x"] * 3}, timeout=60)
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 3


def test_the_server_stream_interval_is_a_floor_for_requests(capped) -> None:
    def counts(**extra) -> list[int]:
        body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 13,
                "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 1, **extra}
        events = []
        with httpx.stream("POST", f"{capped.base_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                    events.append(len(logprobs["tokens"]))
        assert sum(events) == 13
        return events

    def grouped_by(events: list[int], interval: int) -> bool:
        # After the first token at least ``interval`` per event (more when the reader lags).
        return all(n >= interval for n in events[1:-1]) and len(events) <= 1 + -(-12 // interval)

    assert grouped_by(counts(), 4)
    assert grouped_by(counts(stream_interval=1), 4)  # a request may not ask for less
    assert grouped_by(counts(stream_interval=6), 6)

