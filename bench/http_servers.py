"""The servers an HTTP benchmark starts: `kvscale serve` (from this tree or another checkout) and
vLLM's OpenAI server, each in its own process group with its own log; the time each takes to
serve its first request, and the dtype each resolved (bench.http_load, bench.structured_outputs)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, checkout_env
from kvscale.processes import die_with_parent, free_port

# What a server logs when it resolves ``--dtype auto``: kvscale's engine (server/worker/model_loader.py)
# and vLLM's engine configuration line.
_RESOLVED_DTYPE = (re.compile(r"--dtype auto on .*?: (\w+), because"), re.compile(r"\bdtype=torch\.(\w+)"))


def resolved_dtype(log: str) -> str | None:
    """The dtype a server's log says its engine runs in; None where it does not say."""
    for pattern in _RESOLVED_DTYPE:
        if match := pattern.search(log):
            return match.group(1)
    return None


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str
    model: str
    log_path: Path
    argv: list[str]
    spawned_at: float  # perf_counter() just before the spawn
    info: dict[str, Any] = field(default_factory=dict)


def kvscale_argv(engine_flags: dict, port: int, served_model_name: str) -> list[str]:
    """`kvscale serve` with the benchmark's engine limits (the flags vLLM spells the same way)."""
    argv = [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--device", engine_flags["device"],
            "--dtype", engine_flags["dtype"],
            "--max-model-len", str(engine_flags["max_model_len"]),
            "--max-num-seqs", str(engine_flags["max_num_seqs"]),
            "--max-num-batched-tokens", str(engine_flags["max_num_batched_tokens"]),
            "--block-size", str(engine_flags["block_size"]),
            "--enable-prefix-caching" if engine_flags["enable_prefix_caching"] else "--no-enable-prefix-caching",
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if engine_flags.get("kv_cache_memory_bytes"):
        argv += ["--kv-cache-memory-bytes", str(engine_flags["kv_cache_memory_bytes"])]
    return argv


def spawn(name: str, argv: list[str], env: dict[str, str], port: int, model: str, log_dir: Path,
          cwd: Path) -> Server:
    log_path = log_dir / f"{name}.log"
    spawned_at = time.perf_counter()
    with log_path.open("wb") as log:
        # Own process group: vLLM's server runs its engine in a child process, stopped with it.
        # die_with_parent: a benchmark stopped from outside (its finally skipped) leaves no server.
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    return Server(name, proc, f"http://127.0.0.1:{port}", model, log_path, argv, spawned_at)


def start_kvscale(engine_flags: dict, threads: int, model: str, log_dir: Path,
                  extra_args: tuple[str, ...] = (), checkout: Path = REPO, name: str = "kvscale") -> Server:
    """``extra_args``: more `kvscale serve` flags (vLLM's spelling, so the same go to both).
    ``checkout``: the kvscale source tree to serve from (another commit's worktree, for a
    before/after in one run); ``name``: its log's name."""
    from bench.anchors import vllm_cpu

    port = free_port()
    env = checkout_env(checkout, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    # The engine core's OpenMP threads on the very CPUs vLLM's get; both front ends take the rest
    # (none when the run uses every CPU: then they share, on both sides).
    bind = vllm_cpu.omp_threads_bind(threads)
    argv = [*kvscale_argv(engine_flags, port, model), "--omp-threads-bind", bind, *extra_args]
    server = spawn(name, argv, env, port, model, log_dir, checkout)
    server.info.update(omp_threads_bind=bind, checkout=str(checkout))
    return server


def start_vllm(engine_flags: dict, threads: int, model: str, log_dir: Path, enforce_eager: bool,
               extra_args: tuple[str, ...] = (), name: str = "vllm") -> Server:
    """``name``: its log's name (one per vLLM configuration of a run)."""
    from bench.anchors import vllm_cpu

    port = free_port()
    kv_gib = max(1, engine_flags["kv_cache_memory_bytes"] // 1024**3)
    argv = vllm_cpu.server_argv(
        vllm_cpu.ensure_venv(), model=vllm_cpu.model_dir(), served_model_name=model, port=port,
        dtype=engine_flags["dtype"], max_num_seqs=engine_flags["max_num_seqs"],
        max_num_batched_tokens=engine_flags["max_num_batched_tokens"],
        max_model_len=engine_flags["max_model_len"], enable_prefix_caching=engine_flags["enable_prefix_caching"],
        enforce_eager=enforce_eager) + list(extra_args)
    env = vllm_cpu.vllm_env(threads, kv_gib)
    server = spawn(name, argv, env, port, model, log_dir, log_dir)
    server.info.update(omp_threads_bind=env["VLLM_CPU_OMP_THREADS_BIND"], kv_cache_gib=kv_gib,
                       enforce_eager=enforce_eager)
    return server


def log_tail(server: Server, chars: int = 4000) -> str:
    try:
        return server.log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop(server: Server) -> None:
    """SIGINT to the server's process group (graceful), then SIGKILL whatever is left of it."""
    try:
        os.killpg(server.proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


async def first_served(server: Server, timeout_s: float) -> float:
    """Seconds from spawning the server to the end of its first completion (a 2-token request)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=60) as http:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} server exited ({server.proc.returncode}):\n{log_tail(server)}")
            try:
                if (await http.get(f"{server.base_url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} server not healthy after {timeout_s:.0f} s:\n{log_tail(server)}")
            await asyncio.sleep(0.25)
        response = await http.post(f"{server.base_url}/v1/completions",
                                   json={"model": server.model, "prompt": [100, 200, 300], "max_tokens": 2,
                                         "ignore_eos": True})
        response.raise_for_status()
        served_s = time.perf_counter() - server.spawned_at
        version = await http.get(f"{server.base_url}/version")
        if version.status_code == 200:
            server.info["version"] = version.json().get("version")
    return served_s
