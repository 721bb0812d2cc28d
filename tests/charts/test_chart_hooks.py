"""The `helm test` pods, rendered by helm and run here against a real `kvscale serve`: the command
and environment of each pod, as its container would run them, with the URL pointed at the server.

(In a cluster the completion pod goes through the InferenceService's router, which serves the same
/v1 API; running the pods themselves needs a kubelet, which the test control plane's kwok node
does not have.)
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from kvscale.processes import die_with_parent, free_port, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 180, interval=0.5, what="kvscale serve /health")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _test_pods(helm) -> dict[str, dict]:
    docs = helm.template("tests.inferenceService=chat", "tests.namespace=serving")
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    assert set(pods) == {"kvscale-test-completion", "kvscale-test-metrics"}
    for pod in pods.values():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["metadata"]["namespace"] == "serving"
    return pods


def _run(pod: dict, url: str) -> subprocess.CompletedProcess[str]:
    container = pod["spec"]["containers"][0]
    assert container["command"][0] == "python"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) == {"KVSCALE_TEST_URL"}
    return subprocess.run([sys.executable, *container["command"][1:], *container["args"]],
                          env={"KVSCALE_TEST_URL": url, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=180)


def test_test_pods_address_the_named_inference_service(helm):
    pods = _test_pods(helm)
    url = {name: pod["spec"]["containers"][0]["env"][0]["value"] for name, pod in pods.items()}
    assert url["kvscale-test-completion"] == "http://chat.serving.svc"  # its router's Service
    assert url["kvscale-test-metrics"] == "http://chat-pods.serving.svc:8000/metrics"  # a server
    order = {name: int(pod["metadata"]["annotations"]["helm.sh/hook-weight"]) for name, pod in pods.items()}
    assert order["kvscale-test-completion"] < order["kvscale-test-metrics"]
    assert helm.template(show_only=()) and not any(
        d["kind"] == "Pod" for d in helm.template())  # no InferenceService named: no test pods


def test_completion_pod_passes_against_a_server(helm, server):
    result = _run(_test_pods(helm)["kvscale-test-completion"], server)
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m-instruct" in result.stdout


def test_metrics_pod_passes_against_a_server_and_fails_without_a_metric(helm, server):
    pod = _test_pods(helm)["kvscale-test-metrics"]
    result = _run(pod, f"{server}/metrics")
    assert result.returncode == 0, result.stderr
    assert "server metrics exported" in result.stdout
    # Pointed at something that is not a kvscale server's /metrics, it fails and names what lacks.
    result = _run(pod, f"{server}/health")
    assert result.returncode != 0
    assert "missing from /metrics" in result.stderr and "vllm:kv_cache_usage_perc" in result.stderr
