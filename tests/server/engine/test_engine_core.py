"""The engine core process behind `kvscale serve`: it dies, the front end says so and never hangs;
it warms up before /health says ready."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess, scrape  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = ("--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "64",
         "--max-model-len", "512")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServeProcess]:
    """One `kvscale serve` for the tests below that only ask it things, in file order: the first
    (test_first_request_is_as_fast_as_the_second) needs its first requests and new kernel caches
    (as in a new pod), the last (test_the_core_stops_with_the_front_end) stops it."""
    from kvscale.model_files import cache_root

    # The converted model is reused; the kernel caches (under the cache and the temp folder) are new.
    root = tmp_path_factory.mktemp("fresh-caches")
    cache = root / "cache"
    cache.mkdir()
    for entry in cache_root().iterdir():
        if entry.name != "native":
            (cache / entry.name).symlink_to(entry)
    (root / "tmp").mkdir()
    proc = ServeProcess(*SMALL, env={"KVSCALE_CACHE": str(cache), "TMPDIR": str(root / "tmp")}, log_name="core")
    yield proc
    proc.stop()


def core_pid(server: ServeProcess) -> int:
    """The engine core's pid, as the start-up line says it: a child of the serve process."""
    match = re.search(r"engine core pid (\d+)", server.log())
    assert match, server.log()
    pid = int(match.group(1))
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    assert str(pid) in children and pid != server.proc.pid, (pid, children)
    return pid


def _ttft(base_url: str, prompt: str) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise AssertionError("no token streamed")


def test_first_request_is_as_fast_as_the_second(server: ServeProcess) -> None:
    """No built C kernels (as in a new pod): they are built and every path runs during the
    warm-up, before /health says ready, not in the first request."""
    # Ready means built: the library is in the new cache before any request asks for it.
    native = Path(server.env["KVSCALE_CACHE"]) / "native"
    built = sorted(native.glob("*.so")) + sorted(Path(server.env["TMPDIR"]).glob("kvscale-native-*/*.so"))
    assert built, (list(native.iterdir()) if native.exists() else "no native folder", server.log())
    first = _ttft(server.base_url, "The first prompt of this replica's life, rather long: " * 4)
    second = _ttft(server.base_url, "Another prompt, as long as the first one, of other words: " * 4)
    # What else a first request could pay for once (a lazy import, a first-time code path) shows
    # in time only. Building the kernels takes seconds; a step of this size, milliseconds. The
    # slack is for a shared CI machine, where one request here took 1.8 s and the next 0.24 s.
    assert first <= 2 * second + 2.5, (first, second)
    assert "warmed up in" in server.log()
    # Then what start-up built (torch, transformers: 218,527 objects here) leaves the garbage
    # collector's full passes, which would walk it between two steps: 310 ms on an H200's
    # host at 256 sequences, every stream stalled.
    frozen = re.search(r"(\d+) start-up objects frozen out of the garbage collector", server.log())
    assert frozen and int(frozen.group(1)) > 100_000, server.log()


def test_the_front_end_ends_a_stop_string_and_the_core_frees_its_blocks(server: ServeProcess) -> None:
    """The core sends token ids; the front end makes the text and finds stop strings. A stop
    string ends the answer where it begins, and the core is told to abort: it generates a few
    tokens more at most (not the 400 asked for) and holds no KV block afterwards."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": "smollm2-135m-instruct", "prompt": "Count: 1, 2, 3,", "temperature": 0}
    free = client.completions.create(**ask, max_tokens=24, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = next(word for word in text.split() if text.index(word) > 0)
    before = scrape(server.base_url)["vllm:generation_tokens_total"]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**ask, max_tokens=400, stop=[stop], stream=True,
                                                    extra_body={"ignore_eos": True}))
            answer = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            done = client.completions.create(**ask, max_tokens=400, stop=[stop],
                                             extra_body={"ignore_eos": True})
            answer, finish = done.choices[0].text, done.choices[0].finish_reason
        assert (answer, finish) == (text[: text.index(stop)], "stop")
    # The core's last steps before the aborts take what they take on this machine: its blocks
    # are awaited, not a fixed time. A request left running holds blocks until its 400 tokens.
    deadline = time.monotonic() + 30
    while (after := scrape(server.base_url))["kvscale:kv_blocks_active"] != 0:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["vllm:generation_tokens_total"] - before < 2 * 40, after


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_the_front_end_holds_the_tokenizer_not_torch(server: ServeProcess) -> None:
    """The front end tokenizes, checks and streams; torch and the weights live in the core only.
    It imported torch through EngineConfig (the structured-outputs package) and peaked at 636 MiB:
    with the core, more than the 2Gi pods of the real-node lane, OOMKilled in a loop."""
    core = core_pid(server)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    # Every path of the front end: completions with logprobs, streamed chat, a grammar,
    # tokenize and detokenize.
    done = client.completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=4,
                                     logprobs=2, temperature=0)
    assert done.choices[0].logprobs is not None
    chunks = list(client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True))
    assert chunks
    constrained = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert constrained.choices[0].message.content in ("yes", "no")
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello"}, timeout=10).json()["tokens"]
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens},
                      timeout=10).json()["prompt"] == "Hello"

    front = server.proc.pid
    assert "libtorch" not in Path(f"/proc/{front}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{core}/maps").read_text()  # the check can tell
    # 147 MiB measured (the tokenizer, FastAPI, ZMQ); torch alone is over 500 MiB.
    assert _status_mib(front, "VmHWM") < 300, _status_mib(front, "VmHWM")


def test_the_core_stops_with_the_front_end(server: ServeProcess) -> None:
    """SIGINT to the front end (as a terminal's Ctrl-C or ServeProcess.stop) ends both; the last
    test of the module's server."""
    pid = core_pid(server)
    server.stop()
    # A clean stop, as a shell sees Ctrl-C: no traceback a user would take for a crash.
    assert server.proc.returncode == 130, server.proc.returncode
    assert "Traceback" not in server.log_path.read_text()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the engine core outlived its front end"
        time.sleep(0.1)


def test_a_killed_core_fails_open_requests_health_and_new_requests() -> None:
    server = ServeProcess(*SMALL, log_name="core-killed")
    try:
        pid = core_pid(server)
        assert pid != server.proc.pid
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        long = {"model": "smollm2-135m-instruct", "prompt": "Count:", "max_tokens": 480,
                "ignore_eos": True, "temperature": 0}
        # One streaming and one non-streaming request in flight when the core dies.
        blocking: dict[str, object] = {}

        def unary() -> None:
            try:
                blocking["response"] = httpx.post(f"{server.base_url}/v1/completions", json=long, timeout=60)
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                blocking["response"] = exc

        thread = threading.Thread(target=unary)
        thread.start()
        stream = client.completions.create(
            model="smollm2-135m-instruct", prompt="Count:", max_tokens=480, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
        assert "SIGKILL" in str(caught.value), caught.value
        thread.join(30)
        assert not thread.is_alive(), "the non-streaming request hangs"
        response = blocking["response"]
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert time.monotonic() - started < 10

        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        again = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
        log = server.log()
        assert f"engine core process (pid {pid}) was killed by SIGKILL" in log, log
    finally:
        server.stop()
    assert server.proc.returncode is not None


def test_a_core_that_cannot_start_says_why_and_serve_exits_2() -> None:
    """A flag only the engine can judge (a context longer than the model's): the core's reason
    reaches the command line."""
    result = subprocess.run(
        [sys.executable, "-m", "kvscale", "serve", "--port", "0", *SMALL[:-1], "1000000"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "max_model_len 1000000 exceeds what the model supports" in result.stderr, result.stderr[-3000:]


def test_a_front_end_that_fails_to_load_ends_the_core_it_started(tmp_path) -> None:
    """The front end loads its tokenizer while the core starts (EngineCoreClient.launch): when
    that load fails, the core already started is ended, not left behind."""
    import multiprocessing

    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.engine_core_client import EngineCoreClient

    def fail() -> None:
        raise FileNotFoundError("no tokenizer here")

    with pytest.raises(FileNotFoundError, match="no tokenizer here"):
        EngineCoreClient.launch(EngineConfig(model=str(tmp_path), device="cpu"), load_tokenizer=fail)
    assert not multiprocessing.active_children()
