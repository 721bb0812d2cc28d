"""The servers' Deployment and Services built from the spec: a pure mapping, checked field by
field."""

from __future__ import annotations

import pytest

from kvscale.operator.children import labels, servers
from kvscale.operator.children.servers import build_deployment
from kvscale.operator.spec import parse_spec


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_deployment_runs_kvscale_serve_with_engine_flags():
    spec = parse_spec({
        "model": {"uri": "pvc://weights/llama/3b", "servedName": "llama"},
        "image": "registry.local/kvscale:dev",
        "engine": {"blockSize": 32, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096,
                   "maxModelLen": 2048, "dtype": "bfloat16", "gpuMemoryUtilization": 0.8,
                   "enablePrefixCaching": False, "extraArgs": ["--max-queue-len=100"]},
        "resources": {"gpus": 2, "cpu": "8", "memory": "32Gi"},
        "replicas": 3,
        "apiKeySecretRef": {"name": "llm-key"},
    })
    deployment = servers.build_deployment("llama", "team-a", spec)
    c = container(deployment)
    assert c["image"] == "registry.local/kvscale:dev"
    assert c["command"] == ["kvscale"] and c["args"][0] == "serve"
    args = c["args"]
    assert flag(args, "--model") == "/models/pvc/weights/llama/3b"
    assert flag(args, "--served-model-name") == "llama"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--block-size") == "32"
    assert flag(args, "--max-num-seqs") == "64"
    assert flag(args, "--max-num-batched-tokens") == "4096"
    assert flag(args, "--max-model-len") == "2048"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--gpu-memory-utilization") == "0.8"
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert args[-1] == "--max-queue-len=100"
    assert "--api-key" not in args  # never in the pod spec in clear
    key_env = next(e for e in c["env"] if e["name"] == "KVSCALE_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}

    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["resources"]["requests"]["cpu"] == "8" and c["resources"]["limits"]["memory"] == "32Gi"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["metadata"]["namespace"] == "team-a"

    pod = deployment["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in c["volumeMounts"] if m["name"] == claim["name"])
    assert mount["mountPath"] == "/models/pvc/weights" and mount["readOnly"] is True


def test_pod_is_locked_down_and_probed():
    deployment = servers.build_deployment("m", "ns", parse_spec(
        {"model": {"uri": "bundled://smollm2-135m-instruct"}}))
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load
    # A cold start is not rounded up to the probe period (seconds, for the bundled model).
    assert startup["periodSeconds"] == 1
    # A writable /tmp and a model cache volume, since the root filesystem is read-only.
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/models"} <= mounts
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics"}
    # The bundled model is the server's default: no --model flag.
    assert "--model" not in c["args"]
    assert flag(c["args"], "--served-model-name") == "smollm2-135m-instruct"
    assert "--enable-prefix-caching" in c["args"]


def test_labels_selectors_and_scheduling():
    spec = parse_spec({
        "model": {"uri": "hf://org/tiny"},
        "nodeSelector": {"gpu": "a100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"gpus": 0},
    })
    deployment = servers.build_deployment("tiny", "ns", spec)
    label = {"serving.kvscale.io/inferenceservice": "tiny"}
    assert deployment["spec"]["selector"]["matchLabels"] == label
    assert label.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert label.items() <= deployment["metadata"]["labels"].items()
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "a100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nvidia.com/gpu" not in container(deployment)["resources"]["requests"]
    # hf:// is fetched by an init container into the shared model volume.
    init = pod["initContainers"][0]
    assert init["command"][:3] == ["hf", "download", "org/tiny"]
    assert flag(container(deployment)["args"], "--model") == "/models/hf/org/tiny"
    assert labels.selector_string("tiny") == "serving.kvscale.io/inferenceservice=tiny"


def test_services():
    bundled = {"model": {"uri": "bundled://smollm2-135m-instruct"}}
    service = servers.build_service("m", "ns", parse_spec(bundled))
    headless = servers.build_headless_service("m", "ns")
    assert service["metadata"]["name"] == "m"
    # The service's URL is the router's; without a router it spreads over the servers.
    assert service["spec"]["selector"] == {"serving.kvscale.io/router": "m"}
    direct = servers.build_service("m", "ns", parse_spec({**bundled, "router": {"enabled": False}}))
    assert direct["spec"]["selector"] == {"serving.kvscale.io/inferenceservice": "m"}
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert headless["metadata"]["name"] == "m-pods"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == 8000
    assert labels.service_url("m", "ns") == "http://m.ns.svc.cluster.local"


def test_a_cpu_server_sizes_its_kv_cache_to_its_memory_limit():
    """Found on the real-node lane: the CPU KV cache was 2 GiB whatever the limit, and a server
    limited to 2Gi was OOMKilled before it served (the process runtime enforces no limits).
    Then again when the engine core became a process of its own: a quarter of the whole limit
    went to the KV cache as if the core were alone, and the front end and the core together were
    OOMKilled at 2Gi. Both processes are set aside before the share is taken."""
    from kvscale.cli import build_parser
    from kvscale.operator.server_memory import (
        CPU_KV_CACHE_SHARE,
        SERVER_PROCESSES_BYTES,
        cpu_kv_cache_bytes,
        quantity_bytes,
    )

    assert [quantity_bytes(q) for q in ("2Gi", "512Mi", "1G", "1e9", "2147483648")] == [
        2 * 2**30, 512 * 2**20, 10**9, 10**9, 2**31]
    # Both processes count: the front end's measured peak (147 MiB) and the core's runtime.
    assert SERVER_PROCESSES_BYTES >= 1 * 2**30
    assert cpu_kv_cache_bytes("2Gi") == int((2 * 2**30 - SERVER_PROCESSES_BYTES) * CPU_KV_CACHE_SHARE)
    assert cpu_kv_cache_bytes("2Gi") == 256 * 2**20
    assert cpu_kv_cache_bytes("8Gi") == 1792 * 2**20
    cpu = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"},
                      "resources": {"gpus": 0, "memory": "2Gi"}})
    args = build_deployment("m", "ns", cpu)["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser("serve").parse_args([a.replace("$(POD_NAME)", "m-0") for a in args])
    assert parsed.kv_cache_memory_bytes == 256 * 2**20
    gpu = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": 1}})
    assert "--kv-cache-memory-bytes" not in build_deployment("m", "ns", gpu)["spec"]["template"]["spec"][
        "containers"][0]["args"]
    given = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": 0},
                        "engine": {"extraArgs": ["--kv-cache-memory-bytes=1000000"]}})
    args = build_deployment("m", "ns", given)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--kv-cache-memory-bytes") == 0 and "--kv-cache-memory-bytes=1000000" in args


def test_a_cpu_server_limit_too_small_for_its_processes_is_refused():
    """A limit the two processes of `kvscale serve` fill before any weights is refused with the
    figures, instead of a Deployment whose pods are OOMKilled in a loop."""
    with pytest.raises(ValueError, match=r"resources.memory 1Gi is too small for a CPU server.*at least 1536Mi"):
        parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"},
                    "resources": {"gpus": 0, "memory": "1Gi"}})
    parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"},
                "resources": {"gpus": 0, "memory": "1536Mi"}})
    # A GPU server's KV cache lives on the card: its memory limit is not split.
    parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": 1, "memory": "1Gi"}})


@pytest.mark.parametrize("cpu,threads", [("2", "2"), ("1500m", "2"), ("0.5", "1"), ("16", "16")])
def test_a_cpu_server_runs_as_many_threads_as_its_cpu_request(cpu: str, threads: str):
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"},
                       "resources": {"gpus": 0, "cpu": cpu, "memory": "8Gi"}})
    env = {e["name"]: e.get("value") for e in container(build_deployment("m", "ns", spec))["env"]}
    assert env["OMP_NUM_THREADS"] == threads
    gpu = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}})
    assert "OMP_NUM_THREADS" not in {e["name"] for e in container(build_deployment("m", "ns", gpu))["env"]}
