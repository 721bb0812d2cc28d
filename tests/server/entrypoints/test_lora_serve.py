"""`kvscale serve --enable-lora --lora-modules ...` end to end: a real server on a tiny random-weight
Llama, the official `openai` client. /v1/models lists each adapter with its parent and root, a
request's `model` naming an adapter is served by it (the same text as the engine in process with
that adapter), an unknown model keeps its 404, and what LoRA cannot run with is refused at start.

The server runs with --allow-runtime-lora-updating, behind an API key, one host-pool slot: an
adapter loaded at run time serves what the same adapter loaded at start does, a malformed one is a
400 naming why while a stream goes on untouched, an unload while a stream on the adapter is open
is a 409, after an unload the name is a 404, and vllm:lora_requests_info shows the running adapter.
Without the flag the routes are 404.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess  # noqa: E402
from tiny_checkpoints import TOKENIZER_FILES, copy_tokenizer, write_tiny_llama  # noqa: E402

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.entrypoints.lora_modules import parse_lora_module
from kvscale.server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
HIDDEN, INTER, Q, KV = 96, 192, 96, 32  # tiny_checkpoints.write_tiny_llama's shapes


def write_peft_adapter(path: Path, seed: int, rank: int, targets: dict[str, tuple[int, int]]) -> None:
    """A LoRA adapter in PEFT's save_pretrained layout; ``targets``: module -> (in, out)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module, (fan_in, fan_out) in targets.items():
            where = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            weights[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(rank, fan_in, generator=gen)
            weights[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(fan_out, rank, generator=gen)
    path.mkdir()
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets),
         "bias": "none", "task_type": "CAUSAL_LM"}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvscale.model_files import resolve_model_path

    root = tmp_path_factory.mktemp("lora-serve")
    base = root / "base"
    base.mkdir()
    copy_tokenizer(resolve_model_path(None), base, (*TOKENIZER_FILES, "chat_template.jinja"))
    write_tiny_llama(base, vocab=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     max_position_embeddings=256, norm_jitter=None)
    write_peft_adapter(root / "sql", 1, 4, {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV),
                                            "down_proj": (INTER, HIDDEN)})
    write_peft_adapter(root / "chat", 2, 8, {"o_proj": (Q, HIDDEN), "gate_proj": (HIDDEN, INTER),
                                             "up_proj": (HIDDEN, INTER)})
    return root


KEY = "lora-key"


@pytest.fixture(scope="module")
def server(checkpoint):
    chat = json.dumps({"name": "chat", "path": str(checkpoint / "chat"), "base_model_name": "tiny-alias"})
    proc = ServeProcess("--model", str(checkpoint / "base"), "--served-model-name", "tiny", "--dtype", "float32",
                        "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
                        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1",
                        "--lora-modules", f"sql={checkpoint / 'sql'}", chat, "--allow-runtime-lora-updating",
                        "--api-key", KEY, env={"OMP_NUM_THREADS": "1"}, log_name="lora")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_models_lists_each_adapter_with_its_parent_and_root(client, checkpoint) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {"tiny", "sql", "chat"}
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(checkpoint / "sql")
    assert cards["chat"]["parent"] == "tiny-alias" and cards["chat"]["root"] == str(checkpoint / "chat")
    assert cards["tiny"]["parent"] is None


def test_a_request_naming_an_adapter_is_served_by_it(client, checkpoint) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint / "base"), dtype="float32", device="cpu",
                                    num_gpu_blocks_override=64, max_model_len=256, enable_lora=True,
                                    lora_modules={"sql": str(checkpoint / "sql"), "chat": str(checkpoint / "chat")}))
    expected = {}
    for name in ("tiny", "sql", "chat"):
        engine.add_request(name, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_name=None if name == "tiny" else name)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                expected[output.request_id] = output.outputs[0].text
    assert len(set(expected.values())) == 3, "the adapters should change the tiny model's text"
    for name in ("sql", "tiny", "chat", "sql"):  # one slot: adapters swap between requests
        assert _complete(client, name) == expected[name], name
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "sql" and chat.choices[0].message.content is not None


def test_an_unknown_model_is_still_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_lora_module_spellings() -> None:
    assert parse_lora_module("a=/x/y") == parse_lora_module('{"name": "a", "path": "/x/y"}')
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "m"}').base_model_name == "m"
    for bad in ("a", "=/p", '{"name": "a"}', '{"name": "a", "path": "/p", "extra": 1}'):
        with pytest.raises(Exception, match="--lora-modules"):
            parse_lora_module(bad)


@pytest.mark.parametrize(("flags", "message"), [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--quantization", "int8"], "--quantization"),
    (["--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras (1) must be at least --max-loras (2)"),
])
def test_what_lora_cannot_run_with_is_refused_at_start(flags, message, capsys, checkpoint) -> None:
    import argparse

    from kvscale.server.entrypoints import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(checkpoint / "base"), "--enable-lora",
                              "--lora-modules", f"sql={checkpoint / 'sql'}", *flags])
    assert cli_serve.run(args) == 2
    assert message in capsys.readouterr().err


def _update(server: ServeProcess, route: str, key: str | None = KEY, **body: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, headers=headers, timeout=60)


def _tokens(client: openai.OpenAI, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].logprobs.tokens


def test_without_the_flag_the_update_routes_are_404() -> None:
    from starlette.testclient import TestClient

    from kvscale.server.engine.engine_front import EngineFront
    from kvscale.server.entrypoints.api_server import build_app

    for allow, status in ((False, 404), (True, 400)):  # with it: an engine that cannot load adapters says so
        app = build_app(EngineFront(), tokenizer=None, served_model_names=["m"], max_model_len=16, vocab_size=8,
                        allow_runtime_lora_updating=allow)
        answer = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert answer.status_code == status, answer.text
        assert TestClient(app).post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_an_adapter_loaded_at_run_time_serves_as_one_loaded_at_start(server, client, checkpoint) -> None:
    assert _update(server, "load_lora_adapter", key=None, lora_name="sql2", lora_path="/x").status_code == 401
    loaded = _update(server, "load_lora_adapter", lora_name="sql2", lora_path=str(checkpoint / "sql"))
    assert loaded.status_code == 200, loaded.text
    assert _update(server, "load_lora_adapter", lora_name="chat2", lora_path=str(checkpoint / "chat")).status_code == 200
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["sql2"]["parent"] == "tiny" and cards["sql2"]["root"] == str(checkpoint / "sql")
    # One host-pool slot: every turn reads its adapter again from its path.
    results = {(turn, name): _tokens(client, name) for turn, name in enumerate(("sql", "sql2", "chat2", "sql2"))}
    assert results[(0, "sql")] == results[(1, "sql2")] == results[(3, "sql2")] != results[(2, "chat2")]
    assert results[(0, "sql")] != _tokens(client, "tiny")
    chat = client.chat.completions.create(model="sql2", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0)
    assert chat.model == "sql2"
    again = _update(server, "load_lora_adapter", lora_name="sql2", lora_path=str(checkpoint / "chat"))
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]


def test_a_malformed_adapter_is_400_naming_why_and_a_stream_goes_on(server, client, checkpoint,
                                                                     tmp_path) -> None:
    write_peft_adapter(tmp_path / "rank", 3, 32, {"q_proj": (HIDDEN, Q)})
    write_peft_adapter(tmp_path / "target", 4, 4, {"q_proj": (HIDDEN, Q), "lm_head": (HIDDEN, 8)})
    write_peft_adapter(tmp_path / "shape", 5, 4, {"q_proj": (HIDDEN, KV)})
    shutil.copytree(checkpoint / "sql", tmp_path / "torn")
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    expected = "".join(_tokens(client, "sql"))
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    text = next(iter(stream)).choices[0].text
    for name, why in (("rank", "rank 32 is above --max-lora-rank 16"), ("target", "target_modules ['lm_head']"),
                      ("shape", "the model's projection is 96 -> 96"), ("torn", "could not be read"),
                      ("missing", "must hold adapter_config.json")):
        answer = _update(server, "load_lora_adapter", lora_name=name, lora_path=str(tmp_path / name))
        assert answer.status_code == 400, (name, answer.text)
        assert why in answer.json()["error"]["message"], (name, answer.json())
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected
    assert _update(server, "load_lora_adapter", lora_name="tiny", lora_path=str(checkpoint / "sql")).status_code == 400
    assert _update(server, "load_lora_adapter", lora_name="", lora_path="/x").status_code == 400
    assert {m.id for m in client.models.list().data}.isdisjoint({"rank", "target", "shape", "torn", "missing"})


def test_an_unload_while_a_stream_is_open_is_409_then_the_name_is_404(server, client, checkpoint) -> None:
    assert _update(server, "load_lora_adapter", lora_name="gone", lora_path=str(checkpoint / "chat")).status_code == 200
    stream = client.completions.create(model="gone", prompt=PROMPT, max_tokens=240, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    refused = _update(server, "unload_lora_adapter", lora_name="gone")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "lora_adapter_in_use"
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="gone",waiting_lora_adapters=""}' in metrics
    assert 'kvscale:lora_requests_total{lora_name="gone",model_name="tiny"} 1.0' in metrics
    assert sum(1 for _ in chunks) > 0  # the stream runs to its end, untouched
    assert _update(server, "unload_lora_adapter", lora_name="gone").status_code == 200
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gone", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert "gone" not in {m.id for m in client.models.list().data}
    assert 'lora_name="gone"' not in httpx.get(f"{server.base_url}/metrics", timeout=10).text
    again = _update(server, "unload_lora_adapter", lora_name="gone")
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"


def test_runtime_updating_needs_enable_lora(capsys, checkpoint) -> None:
    import argparse

    from kvscale.server.entrypoints import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    assert cli_serve.run(parser.parse_args(["--model", str(checkpoint / "base"), "--allow-runtime-lora-updating"])) == 2
    assert "--allow-runtime-lora-updating needs --enable-lora" in capsys.readouterr().err


def test_through_a_router_an_adapter_loaded_at_run_time_comes_back_to_a_replica_that_lost_it(
        server, client, checkpoint) -> None:
    """`kvscale router --allow-runtime-lora-updating` (its app on a thread of this process) in
    front of this real server, which it reaches through a relay: a load through the router serves
    the adapter through it; the replica then goes away and comes back without the adapter (the
    relay closed, the adapter unloaded, the relay open again: a restarted pod at its address), and
    the router loads it again from its record (docs/router.md, "Replicas that join later"); once
    unloaded through the router it is not loaded again."""
    from kvscale.processes import wait_until
    from kvscale.router.config import RouterConfig
    from tests.router.conftest import InProcessRouters
    from tests.router.tcp_relay import Relay

    relay = Relay(server.port)
    routers = InProcessRouters()
    try:
        router = routers.start(RouterConfig(replicas=[f"http://127.0.0.1:{relay.port}"], models=[],
                                            policy="round-robin", health_interval_s=0.3,
                                            allow_runtime_lora_updating=True, replica_api_key=KEY))

        def replica_healthy() -> bool:
            return httpx.get(f"{router}/health", timeout=5).json()["replicas"][0]["healthy"]

        wait_until(replica_healthy, 30, what="the router's replica")
        loaded = httpx.post(f"{router}/v1/load_lora_adapter",
                            json={"lora_name": "kept", "lora_path": str(checkpoint / "chat")}, timeout=60)
        assert loaded.status_code == 200, loaded.text
        routed = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=60)
        expected = _complete(client, "kept")
        assert _complete(routed, "kept") == expected

        def served() -> set[str]:
            return {m.id for m in client.models.list().data}

        relay.close()
        wait_until(lambda: not replica_healthy(), 30, what="the replica gone")
        assert _update(server, "unload_lora_adapter", lora_name="kept").status_code == 200
        relay = Relay(server.port, port=relay.port)
        wait_until(lambda: "kept" in served(), 30, what="the router's replay of the adapter")
        # The router learns the replica's models from its next health check: until then it 404s.
        wait_until(lambda: "kept" in {m.id for m in routed.models.list().data}, 30,
                   what="the router seeing the adapter on the replica")
        assert _complete(routed, "kept") == expected
        replays = httpx.get(f"{router}/metrics", timeout=10).text
        assert 'kvscale_router_lora_replays_total{result="loaded"} 1.0' in replays, replays[-2000:]
        unloaded = httpx.post(f"{router}/v1/unload_lora_adapter", json={"lora_name": "kept"}, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        time.sleep(1.0)  # three health passes: no replay of what was unloaded
        assert "kept" not in served()
    finally:
        routers.stop_all()
        relay.close()
        _update(server, "unload_lora_adapter", lora_name="kept")
