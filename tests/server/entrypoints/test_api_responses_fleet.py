"""Stored responses shared by the fleet (`--responses-store redis`): two real replicas of the
bundled model on one Redis, the official `openai` client; a conversation started on one replica
continues, is read and is deleted on the other."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvscale.processes import free_port, wait_for_port

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[list[openai.OpenAI]]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make system-deps installs Debian's redis-server)"
    port = free_port()
    redis = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                              "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[ServeProcess] = []
    try:
        wait_for_port(port, 10, what="redis-server")

        def start(name: str) -> ServeProcess:
            return ServeProcess("--max-model-len", "512", "--num-gpu-blocks-override", "64",
                                "--served-model-name", "smollm2", "--redis", f"redis://127.0.0.1:{port}/0",
                                "--replica-id", name, "--responses-store", "redis", log_name=f"responses-{name}")

        with ThreadPoolExecutor(2) as pool:
            servers.extend(pool.map(start, ["a", "b"]))
        yield [openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
               for server in servers]
    finally:
        for server in servers:
            server.stop()
        redis.kill()
        redis.wait(10)


def test_a_conversation_moves_between_replicas(replicas) -> None:
    a, b = replicas
    first = a.responses.create(model="smollm2", input="Name a colour.", max_output_tokens=3, temperature=0)
    second = b.responses.create(model="smollm2", input="And another?", previous_response_id=first.id,
                                max_output_tokens=1, temperature=0)
    # Replica b rendered replica a's conversation: its prompt holds the first turn and answer.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert b.responses.retrieve(first.id).output_text == first.output_text
    a.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(second.id)
