"""Helpers for the HTTP server tests: a real `kvscale serve` process on loopback, and /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvscale.processes import free_port

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


class ServeProcess:
    """`kvscale serve ARGS` on 127.0.0.1 and a free port; ready once /health answers 200."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log_name: str = "serve") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = dict(env or {})  # what the test set on top of its own environment
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvscale-{log_name}-{self.port}.log"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--uvicorn-log-level", "warning", *args],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvscale serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        log = self.log()  # before stop(), which closes the log file
        self.stop()
        raise RuntimeError(f"kvscale serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{log}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serve_app_in_thread(app: object) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` (build_app's, over an engine in this process) on 127.0.0.1 and a free port, served
    from a thread; returns once uvicorn is listening. Stop it with ``server.should_exit = True``."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics as `name{label=value,...}` (labels sorted) and bare `name` -> value."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_for_idle_pool(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held; returns the scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(base_url)
        idle = (samples.get("kvscale:kv_blocks_active") == 0
                and samples.get("vllm:num_requests_running") == 0
                and samples.get("vllm:num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)
