"""`kvscale serve --tensor-parallel-size 2 --nnodes 2` with `kvscale serve --headless --node-rank 1`
on this machine: the headless node killed under a stream fails that stream and /health (503
naming the node), never a hang; the leader killed, the headless node exits non-zero within
seconds (so a LeaderWorkerSet restarts the group); settings refused before anything starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import REPO, ServeProcess  # noqa: E402
from tiny_checkpoints import write_tiny_served_llama  # noqa: E402

from kvscale.processes import free_port

pytestmark = pytest.mark.slow

KEY = "serve-nodes-secret-key"


@pytest.fixture
def tiny_llama(tmp_path):
    return write_tiny_served_llama(tmp_path)


def _pair(model: Path, name: str) -> tuple[subprocess.Popen[str], ServeProcess]:
    """The headless node first (it waits for the leader), then the leader, ready once healthy."""
    port = str(free_port())
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    env = {"KVSCALE_TP_AUTHKEY": KEY, "OMP_NUM_THREADS": "1"}
    node = subprocess.Popen([sys.executable, "-m", "kvscale", "serve", "--headless", "--model", str(model),
                             "--node-rank", "1", *nodes], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        leader = ServeProcess("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32",
                              "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                              "--node-rank", "0", *nodes, env=env, log_name=name)
    except BaseException:
        node.kill()
        print(node.communicate()[0])
        raise
    return node, leader


def test_a_killed_node_fails_the_stream_in_flight_and_health(tiny_llama) -> None:
    node, leader = _pair(tiny_llama, "tp-node-killed")
    try:
        assert "tensor parallel over 2 ranks" in leader.log() and "node 1 (rank 1)" in leader.log(), leader.log()
        client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].text is not None
        node.send_signal(signal.SIGKILL)
        node.wait()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        health = httpx.get(f"{leader.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert re.search(r"node 1 \(rank 1\) on \S+ connection closed", health.json()["error"]["message"]), \
            health.json()
    finally:
        node.kill()
        node.wait()
        leader.stop()


def test_the_headless_node_exits_non_zero_when_the_leader_dies(tiny_llama) -> None:
    node, leader = _pair(tiny_llama, "tp-leader-killed")
    try:
        client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        core = re.search(r"engine core pid (\d+)", leader.log())
        assert core, leader.log()
        # The whole leader goes at once, as its pod would: the core (rank 0) and the front end.
        os.kill(int(core.group(1)), signal.SIGKILL)
        leader.proc.kill()
        began = time.monotonic()
        out, _ = node.communicate(timeout=30)
        assert time.monotonic() - began < 10, out
        assert node.returncode == 1, out
        assert "the leader closed the connection" in out, out
    finally:
        node.kill()
        node.wait()
        leader.stop()


@pytest.mark.parametrize(("flags", "key", "says"), [
    (["--tensor-parallel-size", "2", "--nnodes", "2"], None, "needs $KVSCALE_TP_AUTHKEY"),
    (["--tensor-parallel-size", "2", "--nnodes", "2"], "short", "too short"),
    (["--tensor-parallel-size", "3", "--nnodes", "2"], KEY, "not a multiple of --nnodes 2"),
    (["--headless", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"], None,
     "needs $KVSCALE_TP_AUTHKEY"),
    (["--headless", "--tensor-parallel-size", "3", "--nnodes", "2", "--node-rank", "1"], KEY, "not a multiple"),
    (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"], KEY, "add --headless"),
])
def test_multi_node_settings_refused_at_start(flags: list[str], key: str | None, says: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSCALE_TP_AUTHKEY"} | ({"KVSCALE_TP_AUTHKEY": key} if key else {})
    done = subprocess.run([sys.executable, "-m", "kvscale", "serve", "--device", "cpu", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr, done.stderr
