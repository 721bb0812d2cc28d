"""Helpers for the operator tests: real HTTP metric endpoints standing in for kvscale pods,
and running `kvscale operator` as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from testenv import kwok_toleration

REPO_ROOT = Path(__file__).resolve().parents[2]
KVSCALE_BIN = REPO_ROOT / ".venv" / "bin" / "kvscale"


BUNDLED_MODEL = "smollm2-135m-instruct"


def platform_inference_service(name: str, namespace: str, replicas: int, *, max_model_len: int = 2048,
                               **spec: Any) -> dict[str, Any]:
    """An InferenceService of the bundled model for the whole-platform tests: small enough for
    several replicas on a 2-core machine, its GPU node kwok's; ``spec`` adds or replaces fields."""
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": f"bundled://{BUNDLED_MODEL}"},
            "replicas": replicas,
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "engine": {"maxModelLen": max_model_len, "maxNumSeqs": 16, "maxNumBatchedTokens": 512,
                       "dtype": "float32"},
            "tolerations": [kwok_toleration()],
            **spec,
        },
    }


def install_operator(env: Any, namespace: str) -> None:
    """The operator as a cluster gets it from deploy/ (CRDs, RBAC, its Deployment), and the
    namespace a test's InferenceServices live in. ``env``: tests/cluster/testenv.py's K8sEnv."""
    env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    env.kubectl("apply", "-f", str(REPO_ROOT / "deploy" / "operator.yaml"))
    env.kubectl("create", "namespace", namespace)


@dataclass
class PodMetrics:
    """What one stand-in pod reports; mutate it to change the load."""

    kv_blocks_active: float = 0.0
    kv_blocks_cached: float = 0.0
    kv_blocks_total: float = 1000.0
    num_requests_waiting: float = 0.0
    prefill_tokens_waiting: float = 0.0
    prefill_tokens_per_s: float = 0.0
    delay_s: float = 0.0
    status: int = 200
    omit_kv: bool = False


class _Collector:
    def __init__(self, metrics: PodMetrics, model: str):
        self.metrics, self.model = metrics, model

    def collect(self):
        def gauge(name: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, name, labels=["model_name"])
            family.add_metric([self.model], value)
            return family

        yield gauge("vllm:num_requests_waiting", self.metrics.num_requests_waiting)
        yield gauge("vllm:num_requests_running", 1.0)
        yield gauge("kvscale:prefill_tokens_waiting", self.metrics.prefill_tokens_waiting)
        yield gauge("kvscale:prefill_tokens_per_s", self.metrics.prefill_tokens_per_s)
        if not self.metrics.omit_kv:
            yield gauge("kvscale:kv_blocks_total", self.metrics.kv_blocks_total)
            yield gauge("kvscale:kv_blocks_active", self.metrics.kv_blocks_active)
            yield gauge("kvscale:kv_blocks_cached", self.metrics.kv_blocks_cached)


class MetricsEndpoint:
    """A real HTTP server on 127.0.0.1 serving Prometheus text at /metrics."""

    def __init__(self, metrics: PodMetrics | None = None, model: str = "smollm2-135m-instruct"):
        self.metrics = metrics or PodMetrics()
        registry = CollectorRegistry()
        registry.register(_Collector(self.metrics, model))
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
                if endpoint.metrics.delay_s:
                    time.sleep(endpoint.metrics.delay_s)
                if self.path != "/metrics" or endpoint.metrics.status != 200:
                    self.send_response(404 if self.path != "/metrics" else endpoint.metrics.status)
                    self.end_headers()
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 60.0,
             interval: float = 0.5) -> Any:
    """Poll until `predicate()` is truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # a transient API error while things settle
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


class OperatorProcess:
    """`kvscale operator` as a real subprocess, its output kept in a log file."""

    def __init__(self, kubeconfig: Path, log_path: Path, *extra: str):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KUBECONFIG", None)
        self.proc = subprocess.Popen(
            [str(KVSCALE_BIN) if KVSCALE_BIN.exists() else sys.executable, *(
                [] if KVSCALE_BIN.exists() else ["-m", "kvscale"]),
             "operator", "--kubeconfig", str(kubeconfig),
             # Several operators run at once on this host: no fixed metrics port unless asked.
             *([] if "--metrics-port" in extra else ["--metrics-port", "0"]), *extra,
             # KVSCALE_E2E_VERBOSE=1 keeps every request and handler run in the logs.
             *(["--verbose"] if os.environ.get("KVSCALE_E2E_VERBOSE") else [])],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


class RefusedSpecKube:
    """A Kube holding one InferenceService `chat` in `ns` with ``spec``, for a spec the operator
    refuses: what it writes is recorded, and anything beyond reading the service and writing its
    status fails the test."""

    def __init__(self, spec: dict[str, Any], generation: int = 2) -> None:
        self.spec = spec
        self.generation = generation
        self.writes: list[tuple[str, Any]] = []

    def get(self, path: str) -> dict[str, Any] | None:
        if "inferenceservices" not in path:
            return None
        return {"metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": self.generation},
                "spec": self.spec, "status": {}}

    def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.writes.append((path, body))
        return body

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the refused spec must not reach kube.{name}")
