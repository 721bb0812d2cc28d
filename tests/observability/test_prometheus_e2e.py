"""Every dashboard panel, recording rule and alert, evaluated by a real Prometheus scraping a real
platform: `kvscale up` (Redis, two `kvscale serve` replicas of the bundled model, the router) and
`kvscale operator` on the test control plane, autoscaling an InferenceService under a short load.

kwok pods run no containers, so each pod of the InferenceService is bound to one of the real
replicas: the operator reads it through the documented metrics-url annotation
(--allow-metrics-url-override), and Prometheus scrapes it through a file_sd target carrying the
labels a PodMonitor gives (namespace, pod, inferenceservice). The second replica is only scraped
once the autoscaler has created its pod, as it would be on a cluster.

The router admits two tenants (--tenants, one with a tokens limit, --max-queue-wait) and the
replicas serve a LoRA adapter of the bundled model written here: the load is sent with
both tenants' keys, some of it to the adapter, and one request over the tokens limit is a 429.

Set KVSCALE_OBS_PICTURES=docs/images to refresh the pictures in docs/observability.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from observability_helpers import (  # noqa: E402
    CHART,
    REPO_ROOT,
    committed_dashboards,
    committed_rules,
    panel_queries,
    tools_module,
)
from testenv import kwok_toleration  # noqa: E402

from bench.dashboard_render import render_dashboard  # noqa: E402
from kvscale import metric_names as names  # noqa: E402
from kvscale.operator import scraping  # noqa: E402
from kvscale.processes import free_port, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

NS, NAME, MODEL = "kvscale-obs", "chat", "smollm2-135m-instruct"
LABEL = "serving.kvscale.io/inferenceservice"
ROUTER_LABEL = "serving.kvscale.io/router"
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape interval and more
VALUES = {"namespace": NS, "inferenceservice": NAME, "model_name": MODEL, "pod": ".*",
          "__rate_interval": RATE_INTERVAL}
# A shared system prompt, so the engines' prefix caches (and the router's prediction) pay.
SYSTEM = ("You are a concise assistant for a Kubernetes platform team. Answer in one short "
          "sentence, name the Kubernetes object involved, and never invent flags. ")
# About 28 bf16 blocks of SmolLM2-135M (fp32: 14) beside the 20 of the KV cache, so re-asked
# tickets come back from the host tier.
HOST_TIER_GIB = 0.01
QUESTIONS = ["What restarts a crashed pod?", "What spreads pods over nodes?",
             "What keeps a fixed number of pods?", "What exposes pods on a stable address?",
             "What stores a password for pods?", "What scales pods on CPU?"]
# docs/router.md, "Tenants": the load's workers take turns with these keys. team-b's tokens limit
# is far above what the load asks for: only the one request asking more is refused.
TENANT_KEYS = {"team-a": "sk-obs-team-a", "team-b": "sk-obs-team-b"}
TEAM_B_TOKENS_PER_MINUTE = 100_000
ADAPTER = "ops-lora"  # a LoRA adapter both replicas serve (--lora-modules)


# Panels the load must move (the rest may rightly read 0: no retries, no preemptions...).
MOVED = [("autoscaling", "Scale decisions"), ("autoscaling", "Occupancy signal vs target"),
         ("serving", "Tokens/s in and out"), ("serving", "Prefix-cache hit rate"),
         ("serving", "Preemptions and KV evictions"), ("serving", "Errors by status"),
         ("router", "Traffic per replica"), ("router", "Prefix index size per replica"),
         ("router", "Routing decision latency")]
# Series of a panel the load surely moved, by the query's legend and the series' labels: each
# tenant's requests and tokens, team-b's refusal, the adapter's requests (beside which the base
# model's and the tenants' zeros would pass MOVED alone). The tenants' queue wait may rightly read
# 0: the router's queue holds a request only while none of its replicas has room, and the shared
# prefix sends this load to one of the two.
MOVED_SERIES = [
    *(("router", "Requests and 429s per tenant", "{{tenant}}", {"tenant": t}) for t in TENANT_KEYS),
    ("router", "Requests and 429s per tenant", "{{tenant}} 429 ({{limit}})",
     {"tenant": "team-b", "limit": "tokens"}),
    *(("router", "Tokens per tenant", "{{tenant}}", {"tenant": t}) for t in TENANT_KEYS),
    ("serving", "Requests per LoRA adapter", "{{lora_name}}", {"lora_name": ADAPTER})]


def substitute(expr: str) -> str:
    return re.sub(r"\$(\w+)", lambda m: VALUES[m.group(1)], expr)


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._file = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdout=self._file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env or os.environ.copy(),
                                     cwd=REPO_ROOT)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._file.close()


class Platform:
    """What the test runs and the addresses it learnt."""

    def __init__(self, tmp: Path, env) -> None:
        self.tmp, self.env = tmp, env
        self.procs: list[Proc] = []
        self.replica_urls: list[str] = []
        self.router_url = ""
        self.operator_metrics = ""
        self.prometheus = ""
        self.pods: dict[str, str] = {}  # pod name -> replica URL
        self.router_pods: set[str] = set()
        self.sd_file = tmp / "servers.json"
        self.sd_file.write_text("[]")
        self._stop = threading.Event()
        self.refused: openai.APIStatusError | None = None  # the request over a tenant's limit

    # -- kwok pods bound to real replicas -------------------------------------------------------
    def feed_pods(self) -> None:
        while not self._stop.wait(0.3):
            self.bind_router_pods()
            for name in self.pod_names(LABEL):
                if name in self.pods or len(self.pods) >= len(self.replica_urls):
                    continue
                url = self.replica_urls[len(self.pods)]
                self.point_metrics_url(name, url)
                self.pods[name] = url
                targets = [{"targets": [u.removeprefix("http://")],
                            "labels": {"namespace": NS, "pod": p, "inferenceservice": NAME}}
                           for p, u in self.pods.items()]
                tmp = self.sd_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(targets))
                tmp.replace(self.sd_file)

    def bind_router_pods(self) -> None:
        """The operator reads held requests and cold starts from the router pods' /health: the
        router of `kvscale up` stands in for them."""
        for name in self.pod_names(ROUTER_LABEL):
            if name not in self.router_pods:
                self.point_metrics_url(name, self.router_url)
                self.router_pods.add(name)

    def pod_names(self, label: str) -> list[str]:
        """The service's pods that carry ``label`` (none while the API does not answer)."""
        proc = self.env.kubectl("get", "pods", "-n", NS, "-l", f"{label}={NAME}", "-o", "json", check=False)
        return [pod["metadata"]["name"] for pod in json.loads(proc.stdout)["items"]] if proc.returncode == 0 else []

    def point_metrics_url(self, pod: str, url: str) -> None:
        self.env.kubectl("annotate", "pod", pod, "-n", NS, "--overwrite",
                         f"serving.kvscale.io/metrics-url={url}/metrics")

    def query(self, path: str, **params) -> dict:
        response = httpx.get(f"{self.prometheus}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]


def make_adapter(path: Path) -> Path:
    """A LoRA adapter of the bundled model, rank 4 on every layer's q_proj and v_proj, its A and B
    random and non-zero, written in PEFT's save_pretrained layout (the files and names the server's
    loader reads; tests/server/worker/test_lora_engine.py proves that loader against PEFT itself).
    Written from the model's config alone, in a fraction of a second: loading the model into PEFT
    held the platform's setup back by tens of seconds on a busy two-core machine."""
    import numpy as np
    from safetensors.numpy import save_file

    from kvscale.model_files import resolve_model_path

    model = resolve_model_path(None)
    config = json.loads((model / "config.json").read_text())
    hidden, heads, rank = config["hidden_size"], config["num_attention_heads"], 4
    head_dim = config.get("head_dim") or hidden // heads
    out = {"q_proj": heads * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    rng = np.random.default_rng(0)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module, fan_out in out.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.1, (rank, hidden)).astype(np.float32)
            weights[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.1, (fan_out, rank)).astype(np.float32)
    path.mkdir()
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(out),
         "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model)}))
    return path


def write_tenants(path: Path) -> Path:
    path.write_text(yaml.safe_dump([
        {"name": "team-a", "api_key": TENANT_KEYS["team-a"], "weight": 2},
        {"name": "team-b", "api_key": TENANT_KEYS["team-b"],
         "tokens_per_minute": TEAM_B_TOKENS_PER_MINUTE}]))
    return path


def start_up(platform: Platform, adapter: Path) -> Proc:
    """`kvscale up` with its router started first (it holds requests while the replicas load, as
    a service scaling from zero), tenants and a queue in the router, and replicas with a host KV
    tier and the adapter; returns once the router listens."""
    port = int(platform.router_url.rsplit(":", 1)[1])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("KVSCALE_API_KEY", None)
    up = Proc([sys.executable, "-m", "kvscale", "up", "--replicas", "2", "--port", str(port),
               "--num-gpu-blocks-override", "20", "--max-model-len", "256",
               "--max-num-seqs", "2", "--kv-offloading-size", str(HOST_TIER_GIB),
               "--hold-timeout", "400", "--tenants", str(write_tenants(platform.tmp / "tenants.yaml")),
               "--max-queue-wait", "120", "--lora-modules", f"{ADAPTER}={adapter}"],
              platform.tmp / "up.log", env)
    platform.procs.append(up)
    wait_until(lambda: "holds requests until a replica is ready" in log_tail(up.log, 100_000)
               or up.proc.poll() is not None, timeout=120, interval=0.2, what="kvscale up's router")
    assert up.proc.poll() is None, log_tail(up.log)
    return up


def wait_up_ready(platform: Platform, up: Proc) -> None:
    wait_until(lambda: "kvscale up: ready" in log_tail(up.log, 100_000) or up.proc.poll() is not None,
               timeout=500, interval=0.5, what="kvscale up")
    time.sleep(0.5)
    text = log_tail(up.log, 100_000)
    assert up.proc.poll() is None, text
    platform.replica_urls = re.findall(r"replica-\d: (http://127\.0\.0\.1:\d+)/v1", text)
    assert len(platform.replica_urls) == 2, text


def start_operator(platform: Platform) -> None:
    port = free_port()
    platform.procs.append(Proc(
        [sys.executable, "-m", "kvscale", "operator", "--kubeconfig", str(platform.env.kubeconfig),
         "--namespace", NS, "--no-leader-elect", "--scrape-interval", "1",
         "--resync-interval", "2", "--scrape-timeout", "0.8", "--allow-metrics-url-override",
         "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
        platform.tmp / "operator.log"))
    platform.operator_metrics = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get_ok(f"{platform.operator_metrics}/metrics"), timeout=60,
               what="operator /metrics")


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_prometheus(platform: Platform) -> None:
    router = platform.router_url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(CHART / "rules" / "kvscale.rules.yaml")],
        "scrape_configs": [
            {"job_name": "kvscale-server",
             "file_sd_configs": [{"files": [str(platform.sd_file)], "refresh_interval": "1s"}]},
            {"job_name": "kvscale-router", "static_configs": [{"targets": [router], "labels": {
                "namespace": NS, "inferenceservice": NAME, "pod": f"{NAME}-router-0"}}]},
            # The operator's series name their InferenceService themselves: keep those labels.
            {"job_name": "kvscale-operator", "honor_labels": True, "static_configs": [{
                "targets": [platform.operator_metrics.removeprefix("http://")],
                "labels": {"pod": "kvscale-operator-0"}}]},
        ],
    }
    path = platform.tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    platform.procs.append(Proc(
        ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={platform.tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        platform.tmp / "prometheus.log"))
    platform.prometheus = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get_ok(f"{platform.prometheus}/-/ready"), timeout=60, what="prometheus")


def inference_service() -> dict:
    return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 0,
                     "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                     "tolerations": [kwok_toleration()],
                     "router": {"enabled": True, "replicas": 1},
                     "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                     "targetKVUsage": 0.1, "targetQueueLength": 1,
                                     "scaleDownStabilizationSeconds": 600}}}


def ask_once(platform: Platform) -> list[str]:
    client = openai.OpenAI(base_url=f"{platform.router_url}/v1", api_key=TENANT_KEYS["team-a"],
                           max_retries=0, timeout=600)
    try:
        client.chat.completions.create(model=MODEL, max_tokens=8,
                                       messages=[{"role": "user", "content": QUESTIONS[0]}])
        return ["ok"]
    except openai.OpenAIError as exc:
        return [repr(exc)]


def load(platform: Platform, seconds: float, workers: int = 3, url: str = "") -> list[str]:
    """Chat requests through the router (or to ``url``), a few streamed, the second worker's to
    the adapter, the workers taking turns with the tenants' keys; returns the failures."""
    keys = list(TENANT_KEYS.values())
    deadline = time.monotonic() + seconds
    failures: list[str] = []

    def worker(i: int) -> None:
        client = openai.OpenAI(base_url=f"{url or platform.router_url}/v1",
                               api_key=keys[i % len(keys)], max_retries=0, timeout=120)
        model = ADAPTER if i == 1 else MODEL
        n = 0
        while time.monotonic() < deadline:
            n += 1
            # A shared system prompt (prefix hits), then a unique ticket number: the pools fill
            # with cached blocks and start evicting. Every fourth asks an older ticket again,
            # whose blocks by then left the KV cache for the host tier.
            ticket = n - 5 if n % 4 == 0 and n > 5 else n
            question = f"{QUESTIONS[(i + ticket) % len(QUESTIONS)]} (ticket {i}-{ticket})"
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}]
            try:
                if n % 3 == 0:
                    for _ in client.chat.completions.create(model=model, messages=messages,
                                                            max_tokens=24, stream=True):
                        pass
                elif n % 3 == 1:
                    # Constrained: a few distinct schemas, so grammars both compile and hit the cache.
                    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10 + n % 4}}}
                    client.chat.completions.create(
                        model=model, messages=messages, max_tokens=24,
                        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
                else:
                    client.chat.completions.create(model=model, messages=messages, max_tokens=24)
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    def bad_requests() -> None:
        # Straight to a replica, every few seconds, so the errors panel has rates to show.
        while time.monotonic() < deadline:
            for body in ({"model": MODEL, "prompt": "x", "max_tokens": -1},
                         {"model": "nope", "prompt": "x"}):
                httpx.post(f"{platform.replica_urls[0]}/v1/completions", json=body, timeout=30)
            time.sleep(3)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    threads.append(threading.Thread(target=bad_requests))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def restores(replica_url: str) -> float:
    """How many promotion batches from the host tier the replica has timed."""
    text = httpx.get(f"{replica_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(names.KV_RESTORE_SECONDS.count))


def restore_from_the_host_tier(platform: Platform) -> None:
    """Make one replica bring a prefix back from its host tier, whatever the load did: ask a
    4-block prompt, push its blocks out of the 20-block KV cache with 4-block prompts that share
    nothing with it (down to the host tier, which keeps the latest 14 blocks or more), ask it
    again. The load's re-asked tickets usually do this, but a slow machine can end the load
    before any re-ask reaches blocks that went down. Token ids as prompts, so each prompt is
    exactly the blocks counted here (on a bare replica 4 pushes are one too few, 5 and 6
    restore)."""
    url = platform.replica_urls[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    block = 16
    before = restores(url)
    for attempt, evictions in enumerate((5, 6)):
        base = 1000 + 5000 * attempt  # distinct ids per prompt: no shared blocks
        kept = list(range(base, base + 4 * block))
        client.completions.create(model=MODEL, prompt=kept, max_tokens=1)
        for k in range(1, evictions + 1):
            start = base + 4 * block * k
            client.completions.create(model=MODEL, prompt=list(range(start, start + 4 * block)),
                                      max_tokens=1)
        client.completions.create(model=MODEL, prompt=kept, max_tokens=1)
        if restores(url) > before:
            return
    raise AssertionError(f"{url} restored nothing from its host tier after 4-block prompts "
                         f"pushed 5 and 6 times out of its KV cache")


def over_the_tokens_limit(platform: Platform) -> openai.APIStatusError | None:
    """A team-b request asking for more tokens than its tokens_per_minute: refused at once."""
    client = openai.OpenAI(base_url=f"{platform.router_url}/v1", api_key=TENANT_KEYS["team-b"],
                           max_retries=0, timeout=30)
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=TEAM_B_TOKENS_PER_MINUTE + 1)
    except openai.APIStatusError as exc:
        return exc
    return None


@pytest.fixture(scope="module")
def platform(k8s_env, tmp_path_factory):
    for tool in ("prometheus", "promtool", "redis-server"):
        assert shutil.which(tool), f"{tool} is missing: run `make system-deps`"
    p = Platform(tmp_path_factory.mktemp("observability"), k8s_env)
    feeder = threading.Thread(target=p.feed_pods, daemon=True)
    try:
        k8s_env.kubectl("apply", "-f", str(REPO_ROOT / "crds"))
        k8s_env.wait_established("inferenceservices.serving.kvscale.io")
        k8s_env.kubectl("create", "namespace", NS)
        p.router_url = f"http://127.0.0.1:{free_port()}"
        start_operator(p)
        start_prometheus(p)
        feeder.start()
        p.started = time.time()
        # The service starts at zero replicas: its first request is held by the router while
        # the operator activates it and the replicas load (a cold start, seen on both sides).
        k8s_env.kubectl("apply", "-f", "-", input=yaml.safe_dump(inference_service()))
        wait_until(lambda: p.router_pods, timeout=60, what="the router pod bound to the router")
        up = start_up(p, make_adapter(p.tmp / ADAPTER))
        held: list[str] = []
        first = threading.Thread(target=lambda: held.extend(ask_once(p)))
        first.start()

        def activated() -> bool:
            status = k8s_env.kubectl_json("get", "kvis", NAME, "-n", NS).get("status") or {}
            return bool(status.get("activationStarted") or status.get("lastColdStartSeconds"))

        wait_until(activated, timeout=120, interval=0.5,
                   what="the operator to see the held request at zero replicas")
        wait_up_ready(p, up)
        first.join(timeout=300)
        assert held == ["ok"], held
        wait_until(lambda: len(p.pods) >= 1, timeout=90, what="the first pod bound to a replica")
        # As on a cluster, the autoscaler watches the quiet service for a while before the load:
        # Prometheus holds the zero of each decision counter, so increase() sees the scale-up.
        decisions = f'{names.OPERATOR_SCALE_DECISIONS.series}{{inferenceservice="{NAME}"}}'
        wait_until(lambda: p.query("query", query=decisions)["result"], timeout=60, interval=1,
                   what="the operator's series in Prometheus")
        time.sleep(2)
        # On a cluster the router would know only the service's one pod, so all of this load
        # would reach it; `kvscale up`'s router knows both replicas from the start and may send
        # everything to the one the operator does not scrape yet (it holds the system prompt after
        # the first request), and the autoscaler would see an idle pod. So this load goes straight
        # to the replica the pod is bound to; the router serves the load after the scale-up.
        p.failures = load(p, 25, url=p.pods[next(iter(p.pods))])

        def scaled() -> bool:
            kvis = k8s_env.kubectl_json("get", "kvis", NAME, "-n", NS)
            return kvis["spec"]["replicas"] == 2 and len(p.pods) == 2

        wait_until(scaled, timeout=90, interval=1, what="the autoscaler to scale to 2")
        p.refused = over_the_tokens_limit(p)
        p.failures += load(p, 20)
        restore_from_the_host_tier(p)
        time.sleep(4)  # a few more scrapes and rule evaluations after the load
        p.ended = time.time()
        yield p
    except Exception as exc:
        logs = "".join(f"\n--- {proc.log.name} ---\n{log_tail(proc.log)}" for proc in p.procs)
        raise AssertionError(f"{exc}{logs}") from exc
    finally:
        p._stop.set()
        k8s_env.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        for proc in reversed(p.procs):
            proc.stop()


def range_query(platform: Platform, expr: str) -> list[dict]:
    return platform.query("query_range", query=expr, start=platform.started, end=platform.ended,
                          step="1")["result"]


def has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def test_the_load_ran_and_the_autoscaler_acted(platform):
    assert platform.failures == []
    kvis = platform.env.kubectl_json("get", "kvis", NAME, "-n", NS)
    assert kvis["status"].get("desiredReplicas") == 2
    text = httpx.get(f"{platform.operator_metrics}/metrics").text
    assert re.search(r'kvscale_operator_scale_decisions_total\{direction="up",inferenceservice="chat",'
                     r'namespace="kvscale-obs",reason="\w+"\} 1\.0', text), text
    refused = platform.refused
    assert refused is not None and refused.status_code == 429, refused
    assert (refused.code, refused.type) == ("rate_limit_exceeded", "tokens"), refused.body


def test_every_process_exports_the_contract(platform):
    """The metric-name contract: every name of kvscale/metric_names.py (so every one a dashboard,
    a rule or the autoscaler uses) is in the real processes' /metrics."""
    def sample_names(url: str) -> set[str]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line and not line.startswith("#")}

    for url in platform.replica_urls:
        exported = sample_names(url)
        for metric in names.SERVER_METRICS:
            assert set(names.exposed_sample_names(metric)) <= exported, (url, metric.name)
        assert set(scraping.WANTED) <= exported  # what the autoscaler reads
    exported = sample_names(platform.router_url)
    for metric in names.ROUTER_METRICS + names.ROUTER_TENANT_METRICS:
        assert set(names.exposed_sample_names(metric)) <= exported, metric.name
    exported = sample_names(platform.operator_metrics)
    for metric in names.OPERATOR_METRICS:
        assert set(names.exposed_sample_names(metric)) <= exported, metric.name


def test_dashboard_variables_list_the_running_service(platform):
    for board in committed_dashboards().values():
        for variable in board["templating"]["list"][1:]:
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"])
            assert match, variable["query"]
            values = platform.query(f"label/{match.group(2)}/values",
                                    **{"match[]": substitute(match.group(1))})
            assert values, f"{board['title']}: variable {variable['name']} lists nothing"
            if variable["name"] != "pod":
                assert VALUES[variable["name"]] in values, (variable["name"], values)


def test_every_panel_query_returns_data(platform, tmp_path):
    empty = []
    results: dict[str, dict[int, list]] = {}
    annotations: dict[str, list[float]] = {}
    boards = committed_dashboards()
    for query in panel_queries():
        result = range_query(platform, substitute(query.expr))
        if not has_data(result):
            empty.append(query.where)
        if query.panel.startswith("annotation "):
            annotations.setdefault(query.dashboard, []).extend(
                float(t) for s in result for t, v in s["values"] if float(v) > 0)
            continue
        panel = next(p for p in boards[query.dashboard]["panels"] if p["title"] == query.panel)
        results.setdefault(query.dashboard, {}).setdefault(panel["id"], []).extend(
            (query.legend, s["metric"], [(float(t), float(v)) for t, v in s["values"]])
            for s in result)
    assert not empty, "no data for:\n" + "\n".join(empty)
    assert annotations.get("autoscaling"), "no scale decision annotation"
    out = Path(os.environ.get("KVSCALE_OBS_PICTURES") or tmp_path)
    if not out.is_absolute():
        out = REPO_ROOT / out
    for name, board in boards.items():
        path = out / f"dashboard-{name}.png"
        render_dashboard(board["title"], board["panels"], results[name],
                         annotations.get(name, []), platform.started, path)
        assert path.stat().st_size > 10_000
    # What the load surely caused shows as a rate above zero, not only as a series.
    idle = []
    for dashboard, title in MOVED:
        panel = next(p for p in boards[dashboard]["panels"] if p["title"] == title)
        if not any(v > 0 for _, _, points in results[dashboard][panel["id"]] for _, v in points):
            idle.append(f"{dashboard} / {title}")
    for dashboard, title, legend, labels in MOVED_SERIES:
        panel = next(p for p in boards[dashboard]["panels"] if p["title"] == title)
        if not any(v > 0 for shown, metric, points in results[dashboard][panel["id"]] for _, v in points
                   if shown == legend and labels.items() <= metric.items()):
            idle.append(f"{dashboard} / {title}: {legend} {labels}")
    assert not idle, f"all zero: {idle}"


def test_every_recording_rule_and_alert_returns_data(platform):
    alerts = tools_module("observability_rules").ALERTS
    rules = {r.get("record") or r["alert"]: r for g in committed_rules()["groups"] for r in g["rules"]}
    empty = []
    for name, rule in rules.items():
        if "record" in rule:
            exprs = [rule["expr"], name]  # the expression, and the series Prometheus recorded
        else:
            alert = next(a for a in alerts if a.name == name)
            # The alert's comparison as 0/1, so a quiet alert still proves its signal exists.
            exprs = [f"{alert.signal} {alert.op} bool {alert.threshold}"]
        for expr in exprs:
            if not has_data(range_query(platform, expr)):
                empty.append(f"{name}: {expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)
    loaded = platform.query("rules")["groups"]
    evaluated = {r["name"]: r for g in loaded for r in g["rules"]}
    assert set(evaluated) == set(rules)
    for name, rule in evaluated.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))


def test_promtool_checks_the_shipped_rules(platform):
    result = subprocess.run(["promtool", "check", "rules", str(CHART / "rules" / "kvscale.rules.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
