"""Tensor-parallel ranks on several nodes (server/worker/tp_nodes.py, tp_headless.py): the
settings refused, then two "nodes" on this machine, an engine as the leader (TP 2, --nnodes 2)
and `kvscale serve --headless --node-rank 1` as a separate process, greedy-equal to TP 1; nodes
with the wrong key or another group's shape refused while the leader keeps waiting; a killed
node failing the next step with an error naming it; a leader's stop ending the node cleanly. TP 4 over 2 nodes runs a local
rank on each: the node's first rank relays each step to its second, and that one killed fails
the leader's next step naming both. The host KV tier's messages reach the node's ranks too: a
prefix restored from it at TP 4 over 2 nodes is greedy-equal to TP 1's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from test_tensor_parallel import NEW_TOKENS, VOCAB, _engine, _generate, _prompts  # noqa: E402
from test_tensor_parallel_kv_tier import (  # noqa: E402
    assert_restored,
    assert_same,
    evict_and_restore,
    host_gib,
    tier_engine,
)
from tiny_checkpoints import (  # noqa: E402
    copy_tokenizer,
    decoder_layer_shapes,
    save_random_weights,
    write_tiny_tp_llama,
)

from kvscale.processes import free_port
from kvscale.server.config import EngineConfig, multi_node_refusal
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.tp_group import RankFailed
from kvscale.server.worker.tp_nodes import NodeLayout, connect_to_leader

REPO = Path(__file__).resolve().parents[3]
KEY = "k" * 16


# --- the decisions ---------------------------------------------------------------------------

def _refusal(size: int = 4, nnodes: int = 2, node_rank: int = 0, *, headless: bool = False,
             authkey: str | None = KEY, addr: str = "10.0.0.1", port: int = 29500) -> str:
    return multi_node_refusal(size, nnodes, node_rank, addr, port, headless=headless, authkey=authkey) or ""


def test_multi_node_settings_accepted() -> None:
    assert _refusal() == ""
    assert _refusal(node_rank=1, headless=True) == ""
    assert _refusal(size=2, nnodes=1, authkey=None) == ""  # one node needs no key
    assert _refusal(size=8, nnodes=4, node_rank=3, headless=True) == ""


def test_multi_node_settings_refused_with_the_reason() -> None:
    assert "not a multiple of --nnodes 2" in _refusal(size=3)
    assert "needs $KVSCALE_TP_AUTHKEY" in _refusal(authkey=None) and "unset" in _refusal(authkey=None)
    assert "too short" in _refusal(authkey="k" * 15)
    assert "at least 16 bytes" in _refusal(node_rank=1, headless=True, authkey="")
    assert "add --headless" in _refusal(node_rank=1)
    assert "needs --node-rank 1 or above" in _refusal(headless=True)
    assert "needs --nnodes above 1" in _refusal(size=2, nnodes=1, headless=True)
    assert "--node-rank must be in 0..1" in _refusal(node_rank=2, headless=True)
    assert "--nnodes must be at least 1" in _refusal(nnodes=0)
    assert "--master-port must be in 1..65534" in _refusal(port=65535)
    with pytest.raises(ValueError, match="KVSCALE_TP_AUTHKEY"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)


def test_layout_places_each_nodes_ranks() -> None:
    layout = NodeLayout(8, 4, 0, "fd00::1", 29500)
    assert [list(layout.node_ranks(n)) for n in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (layout.init_method, layout.step_port) == ("tcp://[fd00::1]:29500", 29501)
    assert layout.node_name(3) == "node 3 (ranks 6-7)"
    assert NodeLayout(2, 2, 1, "a", 1).node_name(1) == "node 1 (rank 1)"


def test_a_node_without_a_leader_gives_up_at_its_deadline() -> None:
    layout = NodeLayout(2, 2, 1, "127.0.0.1", free_port())
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not reach the leader at 127\.0\.0\.1:\d+"):
        connect_to_leader(layout, KEY.encode(), time.monotonic() + 2.0)
    assert time.monotonic() - began < 5


# --- two nodes on this machine --------------------------------------------------------------

@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """A test that fails before closing its engine leaves this process in a torch.distributed
    group, which would refuse the next engine of ranks here."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path, tmp_path_factory) -> Path:
    """test_tensor_parallel.py's checkpoint: 6 query heads, 2 KV heads, 500 vocabulary rows."""
    return write_tiny_tp_llama(bundled_model_path, tmp_path_factory.mktemp("tiny-llama-nodes"), VOCAB)


@pytest.fixture(scope="module")
def one_rank_tokens(tiny_llama, run_to_completion) -> dict[str, list[int]]:
    return _generate(_engine(tiny_llama, 1), _prompts(), run_to_completion, "p")


def _headless(path: Path, port: int, key: str, size: int = 2) -> subprocess.Popen[str]:
    env = {**os.environ, "KVSCALE_TP_AUTHKEY": key, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvscale", "serve", "--headless", "--model", str(path), "--tensor-parallel-size", str(size),
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_decode_as_one(tiny_llama, one_rank_tokens, one_thread_per_rank, run_to_completion,
                                 monkeypatch) -> None:
    monkeypatch.setenv("KVSCALE_TP_AUTHKEY", KEY)
    port = free_port()
    built: dict[str, object] = {}

    def lead() -> None:
        try:
            built["engine"] = LLMEngine(EngineConfig(
                model=str(tiny_llama), dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=8,
                max_num_batched_tokens=24, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port))
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            built["error"] = exc

    leader = threading.Thread(target=lead, daemon=True)
    leader.start()
    impostor = _headless(tiny_llama, port, "x" * 16)
    out, _ = impostor.communicate(timeout=120)
    assert impostor.returncode == 1, out
    assert "refused this node's KVSCALE_TP_AUTHKEY" in out, out
    stranger = _headless(tiny_llama, port, KEY, size=4)  # the key, but another group's shape
    out, _ = stranger.communicate(timeout=120)
    assert stranger.returncode == 1, out
    assert "the leader refused this node: it has --tensor-parallel-size 4 --nnodes 2" in out, out
    node = _headless(tiny_llama, port, KEY)
    try:
        leader.join(timeout=180)
        assert "error" not in built and "engine" in built, built
        engine = built["engine"]
        assert isinstance(engine, LLMEngine)
        assert _generate(engine, _prompts(), run_to_completion, "p") == one_rank_tokens
        # Every node is in: the leader listens no more, so a further connection is refused.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port + 1), timeout=5)
        engine.runner.close()  # type: ignore[attr-defined]
        out, _ = node.communicate(timeout=30)
        assert node.returncode == 0, out  # the leader stopped the group
        assert "the leader stopped the group" in out
    finally:
        node.kill()
        node.wait()


def test_a_killed_node_fails_the_next_step_naming_it(tiny_llama, one_thread_per_rank, monkeypatch) -> None:
    monkeypatch.setenv("KVSCALE_TP_AUTHKEY", KEY)
    port = free_port()
    node = _headless(tiny_llama, port, KEY)
    try:
        engine = LLMEngine(EngineConfig(
            model=str(tiny_llama), dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=8,
            max_num_batched_tokens=24, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port))
        engine.add_request("doomed", _prompts()[1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                    ignore_eos=True))
        engine.step()
        node.send_signal(signal.SIGKILL)
        node.wait()
        with pytest.raises(RankFailed, match=r"node 1 \(rank 1\) on \S+ connection closed"):
            engine.step()
        engine.runner.close()  # type: ignore[attr-defined]
    finally:
        node.kill()
        node.wait()



@pytest.fixture(scope="module")
def eight_head_llama(bundled_model_path, tmp_path_factory) -> Path:
    """A 2-layer Llama of 8 query and 4 KV heads, which 4 ranks divide."""
    path = tmp_path_factory.mktemp("tiny-llama-8-heads")
    copy_tokenizer(bundled_model_path, path)
    hidden, inter = 128, 256
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2}))
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "lm_head.weight": (VOCAB, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(2):
        shapes.update(decoder_layer_shapes(f"model.layers.{i}.", hidden, 8, 4, 16, inter))
    save_random_weights(path, shapes, 0.08, 0.1)
    return path


def test_four_ranks_over_two_nodes_relay_each_step(eight_head_llama, one_thread_per_rank, run_to_completion,
                                                   monkeypatch) -> None:
    one_rank = _generate(_engine(eight_head_llama, 1), _prompts(), run_to_completion, "p")
    monkeypatch.setenv("KVSCALE_TP_AUTHKEY", KEY)
    port = free_port()
    node = _headless(eight_head_llama, port, KEY, size=4)
    try:
        engine = LLMEngine(EngineConfig(
            model=str(eight_head_llama), dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=8,
            max_num_batched_tokens=24, tensor_parallel_size=4, nnodes=2, node_rank=0, master_port=port))
        assert len(engine.runner.ranks.processes) == 1  # type: ignore[attr-defined]  # rank 1; 2-3 the node's
        assert _generate(engine, _prompts(), run_to_completion, "p") == one_rank
        assert node.stdout is not None
        while not (ready := re.search(r"node 1 \(ranks 2-3\) ready \(pids (\d+),(\d+)", node.stdout.readline())):
            assert node.poll() is None
        engine.add_request("doomed", _prompts()[1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                    ignore_eos=True))
        engine.step()
        os.kill(int(ready.group(2)), signal.SIGKILL)
        with pytest.raises(RankFailed, match=r"node 1 \(ranks 2-3\) on \S+ failed: RankFailed: tensor-parallel "
                                             r"(collective failed \()?rank 3 \(pid \d+, exit code -9\)"):
            engine.step()
        engine.runner.close()  # type: ignore[attr-defined]
        assert node.wait(timeout=30) == 1
    finally:
        node.kill()
        node.wait()


def test_four_ranks_over_two_nodes_restore_a_prefix_from_the_host_tier(eight_head_llama, one_thread_per_rank,
                                                                       run_to_completion, monkeypatch) -> None:
    """The host tier's allocation and copies go down the node's connection, and its first rank
    relays them to its second: every rank restores the prefix's blocks of its own KV head."""
    size_gib = host_gib(kv_heads=4)
    one_rank = evict_and_restore(tier_engine(eight_head_llama, 1, size_gib), run_to_completion)
    monkeypatch.setenv("KVSCALE_TP_AUTHKEY", KEY)
    port = free_port()
    node = _headless(eight_head_llama, port, KEY, size=4)
    try:
        engine = tier_engine(eight_head_llama, 4, size_gib, nnodes=2, node_rank=0, master_port=port)
        assert_same(evict_and_restore(engine, run_to_completion), one_rank)
        assert_restored(engine)
        engine.runner.close()  # type: ignore[attr-defined]
        assert node.wait(timeout=30) == 0
    finally:
        node.kill()
        node.wait()
