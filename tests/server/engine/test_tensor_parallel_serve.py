"""`kvscale serve --tensor-parallel-size 2`: what rank 0 alone runs (structured outputs, logprobs,
the metrics, the KV events to Redis) answers as one rank does; a rank killed under a streaming
request fails that request with an error and /health with the rank's name, never a hang."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess, wait_for_idle_pool  # noqa: E402
from tiny_checkpoints import write_tiny_served_llama  # noqa: E402

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import blocks_key
from kvscale.processes import free_port, wait_for_port, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny_llama(tmp_path):
    return write_tiny_served_llama(tmp_path)


def test_a_killed_rank_fails_the_stream_in_flight_and_health(tiny_llama) -> None:
    server = ServeProcess("--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
                          "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                          "--tensor-parallel-size", "2", env={"OMP_NUM_THREADS": "1"}, log_name="tp-killed")
    try:
        found = re.search(r"tensor parallel over 2 ranks \(pids (\d+),(\d+)", server.log())
        assert found, server.log()
        rank_1 = int(found.group(2))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].text is not None
        os.kill(rank_1, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert f"rank 1 (pid {rank_1}, exit code -9)" in health.json()["error"]["message"], health.json()
    finally:
        server.stop()


# Short answers a random model cannot drag out: an enum and a boolean (the backend bounds whitespace).
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
PROMPT = [(7 * i) % 3000 + 100 for i in range(40)]  # two full 16-token blocks and a partial one


def _one_rank(path: Path) -> tuple[list[float], str]:
    """The greedy logprobs and the schema's JSON of one rank in this process: the reference."""
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams

    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                    max_model_len=512))
    engine.add_request("lp", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    engine.add_request("json", PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=
                                                      StructuredOutputsParams(json=json.dumps(SCHEMA))))
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    lp = done["lp"]
    return [step[t].logprob for t, step in zip(lp.token_ids, lp.logprobs, strict=True)], done["json"].text


def test_structured_outputs_logprobs_metrics_and_kv_events_as_one_rank(tiny_llama, tmp_path) -> None:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make system-deps installs Debian's redis-server)"
    port = free_port()
    store = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                              "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        wait_for_port(port, 10, what="redis-server")
        server = ServeProcess("--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
                              "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                              "--tensor-parallel-size", "2", "--redis", f"redis://127.0.0.1:{port}/0",
                              "--replica-id", "tp2", env={"OMP_NUM_THREADS": "1"}, log_name="tp-features")
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        want_logprobs, want_json = _one_rank(tiny_llama)

        scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
        assert scored.choices[0].logprobs is not None
        assert scored.choices[0].logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-4)
        shaped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": SCHEMA}}})
        assert shaped.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(shaped.choices[0].text), SCHEMA)
        assert shaped.choices[0].text == want_json

        samples = wait_for_idle_pool(server.base_url)
        assert samples["vllm:prompt_tokens_total"] == 2 * len(PROMPT)
        assert scored.usage is not None and shaped.usage is not None
        assert samples["vllm:generation_tokens_total"] == scored.usage.completion_tokens + shaped.usage.completion_tokens
        assert samples["vllm:request_success_total{finished_reason=length}"] == 1
        assert samples["vllm:request_success_total{finished_reason=stop}"] == 1
        assert samples["vllm:prefix_cache_hits_total"] >= 32  # the second request's two full blocks
        assert samples["kvscale:kv_blocks_total"] == 64

        # The one block pool, in rank 0, publishes the prompt's full blocks to the router's index.
        published = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        wanted = set(hash_prompt_blocks(PROMPT, 16))
        assert wait_until(lambda: wanted <= {int(m) for m in published.smembers(blocks_key("tp2"))}, 10,
                          interval=0.1), server.log()
    finally:
        if server is not None:
            server.stop()
        store.kill()
        store.wait(10)
