"""The pure parts of bench/anchors/vllm_cpu.py: thread pinning, environment, the server command."""

from __future__ import annotations

import pytest

from bench.anchors.vllm_cpu import omp_threads_bind, server_argv, vllm_env


def test_omp_threads_bind_names_cores_from_zero():
    assert omp_threads_bind(1) == "0"
    assert omp_threads_bind(2) == "0-1"
    assert omp_threads_bind(16) == "0-15"
    with pytest.raises(ValueError):
        omp_threads_bind(0)


def test_vllm_env_pins_threads_and_keeps_the_project_venv_out(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/work/main/.venv")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = vllm_env(2, 3)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "VIRTUAL_ENV" not in env and "PYTHONPATH" not in env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_server_argv_carries_the_engine_limits():
    argv = server_argv("/venv/bin/python", model="/models/smol", served_model_name="smol", port=8001,
                       max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=336)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {name: _flag(argv, name) for name in (
        "--model", "--served-model-name", "--port", "--host", "--dtype", "--max-num-seqs",
        "--max-num-batched-tokens", "--max-model-len", "--seed")} == {
        "--model": "/models/smol", "--served-model-name": "smol", "--port": "8001", "--host": "127.0.0.1",
        "--dtype": "float32", "--max-num-seqs": "32", "--max-num-batched-tokens": "1024",
        "--max-model-len": "336", "--seed": "0"}
    assert "--enable-prefix-caching" in argv and "--enforce-eager" not in argv
    # vLLM's CPU backend chooses its own block size; forcing kvscale's 16 would slow it down.
    assert "--block-size" not in argv


def test_server_argv_switches():
    argv = server_argv("python", model="m", served_model_name="m", port=1, enable_prefix_caching=False,
                       enforce_eager=True)
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--enforce-eager" in argv


def test_a_childs_reply_is_its_marked_line_and_its_end_raises_with_its_log() -> None:
    import subprocess
    import sys

    from bench.anchors.vllm_cpu import child_reply

    script = "print('loading'); print('@@T {\"ready\": 1}', flush=True); print('bye'); raise SystemExit(3)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    assert child_reply(proc, "@@T ", log, "the test child") == {"ready": 1}
    assert log == ["loading"]
    with pytest.raises(SystemExit, match=r"the test child ended \(3\):\nloading\nbye"):
        child_reply(proc, "@@T ", log, "the test child")
