"""The custom metrics API on a process-pod environment: a real Prometheus and a real
prometheus-adapter behind kube-apiserver's aggregation layer, for the real HPA controller.

- Prometheus (Debian's, as the dashboard tests run it) runs on the host, on the pod network's
  gateway address so pods can reach it. Debian builds it without kubernetes_sd ("field
  kubernetes_sd_configs not found"), so a thread here does that discovery: every second it lists
  the pods the chart's servers PodMonitor selects (charts/kvscale/templates/
  observability-podmonitors.yaml: component `inference-server`, managed by the operator, port
  `http`) into a file_sd file, with the labels that PodMonitor gives (namespace, pod,
  inferenceservice).
- prometheus-adapter (tools/prometheus-adapter.sh) runs as a pod in `custom-metrics`, as its
  upstream manifests deploy it: a Deployment under its own ServiceAccount (auth-delegator, the
  extension-apiserver-authentication reader, a resource reader), its rules in a ConfigMap
  (kvscale.operator.hpa.adapter_rules), a serving cert from the environment's CA in a Secret,
  a Service, and APIServices v1beta1/v1beta2 of custom.metrics.k8s.io whose caBundle is that CA.
  kube-apiserver proxies to it through the Service's ClusterIP (the runtime's kube-proxy) with
  its front-proxy client cert (tests/cluster/testenv.py sets the requestheader flags).
- The HPA controller in kube-controller-manager reads it as on any cluster; its sync period is
  testenv.HPA_SYNC_PERIOD_S.

Anything missing (prometheus, the adapter binary, an APIService that never becomes Available) is
an error naming what failed, never a skip.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubelet import Image, KubeletRuntime
from testenv import K8sEnv, PemPair, issue_cert

from kvscale.operator.children.labels import (
    MANAGED_BY,
    ROUTER_COMPONENT,
    ROUTER_LABEL,
    SERVER_COMPONENT,
)
from kvscale.operator.hpa import INFERENCE_SERVICE_LABEL, adapter_rules
from kvscale.operator.spec import NAME_LABEL
from kvscale.processes import die_with_parent, free_port, wait_until

NAMESPACE = "custom-metrics"
ADAPTER = "prometheus-adapter"
# The upstream image's name: the process runtime maps it to the binary tools/ built.
ADAPTER_IMAGE = "registry.k8s.io/prometheus-adapter/prometheus-adapter:v0.12.0"
ADAPTER_PORT = 6443
GROUP = "custom.metrics.k8s.io"
SCRAPE_INTERVAL_S = 1
# The adapter rediscovers series at this period (its default, 10 m, would hide a new pod's
# metric for that long): pods the HPA just created must show up within a sync or two.
RELIST_INTERVAL_S = 5


def pod_targets(env: K8sEnv, selector: str, port_name: str, name_label: str | None,
                namespace: str | None = None) -> list[dict[str, Any]]:
    """file_sd targets for the running pods ``selector`` picks (all namespaces, or one), on their
    port ``port_name``, with the labels a PodMonitor gives (namespace, pod, and inferenceservice
    from the pod's label ``name_label``)."""
    where = ["-n", namespace] if namespace else ["--all-namespaces"]
    pods = env.kubectl_json("get", "pods", *where, "-l", selector)["items"]
    targets = []
    for pod in pods:
        status, meta = pod.get("status") or {}, pod["metadata"]
        if status.get("phase") in ("Failed", "Succeeded") or not status.get("podIP"):
            continue
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []
                 if p.get("name") == port_name]
        labels = {"namespace": meta["namespace"], "pod": meta["name"]}
        if name_label:
            labels[INFERENCE_SERVICE_LABEL] = (meta.get("labels") or {}).get(name_label, "")
        targets += [{"targets": [f"{status['podIP']}:{port}"], "labels": labels} for port in ports]
    return targets


def server_targets(env: K8sEnv) -> list[dict[str, Any]]:
    """file_sd targets for the pods the chart's servers PodMonitor selects, with its labels."""
    return pod_targets(env, f"app.kubernetes.io/managed-by={MANAGED_BY},"
                            f"app.kubernetes.io/component={SERVER_COMPONENT}", "http", NAME_LABEL)


# The chart's other two PodMonitors, for the dashboards (tests/cluster's operator runs from
# deploy/, in kvscale-system): each InferenceService's router, and the operator, whose own series
# already carry namespace and inferenceservice (hence honor_labels, as the PodMonitor says).
PLATFORM_JOBS: dict[str, tuple[str, str, str | None, str | None, bool]] = {
    # job: (selector, port, inferenceservice from, namespace, honor_labels)
    "kvscale-routers": (f"app.kubernetes.io/managed-by={MANAGED_BY},"
                        f"app.kubernetes.io/component={ROUTER_COMPONENT}", "http", ROUTER_LABEL,
                        None, False),
    "kvscale-operator": ("app.kubernetes.io/component=operator", "metrics", None,
                         "kvscale-system", True),
}


def prometheus_config(sd_file: Path, platform: bool = False) -> dict[str, Any]:
    """One scrape job standing for the chart's servers PodMonitor; with ``platform``, also its
    routers and operator PodMonitors (file_sd files beside ``sd_file``, named after the job)."""
    jobs = [{"job_name": "kvscale-servers",
             "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}]
    if platform:
        jobs += [{"job_name": job, "honor_labels": honor,
                  "file_sd_configs": [{"files": [str(sd_file.with_name(f"{job}.json"))],
                                       "refresh_interval": "1s"}]}
                 for job, (_, _, _, _, honor) in PLATFORM_JOBS.items()]
    return {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": "900ms"},
        "scrape_configs": jobs,
    }


@dataclass
class CustomMetrics:
    """A running Prometheus + prometheus-adapter; `stop()` ends what `start` began."""

    env: K8sEnv
    prometheus_url: str
    workdir: Path
    _prometheus: subprocess.Popen | None = None
    _log: Any = None
    objects: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _discovery: threading.Thread | None = None
    platform: bool = False  # also scraping the routers and the operator

    def discover(self, sd_file: Path) -> None:
        """Rewrites ``sd_file`` (atomically: Prometheus watches it) while running, and with
        ``platform`` the routers' and the operator's files beside it."""
        while not self._stop.wait(1.0):
            files = {sd_file: lambda: server_targets(self.env)}
            if self.platform:
                files.update({sd_file.with_name(f"{job}.json"):
                              (lambda args=args: pod_targets(self.env, *args[:4]))
                              for job, args in PLATFORM_JOBS.items()})
            for path, targets_of in files.items():
                try:
                    targets = targets_of()
                except Exception:  # an API hiccup: the next round catches up
                    continue
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(targets))
                tmp.replace(path)

    def query(self, expr: str) -> list[dict[str, Any]]:
        import httpx

        body = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr},
                         timeout=10).json()
        assert body.get("status") == "success", body
        return body["data"]["result"]

    def raw(self, path: str) -> dict[str, Any] | None:
        """GET on the aggregated API through kube-apiserver (None while it does not answer)."""
        proc = self.env.kubectl("get", "--raw", path, check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def pod_metric(self, namespace: str, metric: str, selector: str = "") -> dict[str, float]:
        """custom.metrics.k8s.io's value of ``metric`` for each pod (what the HPA reads)."""
        query = f"?labelSelector={selector}" if selector else ""
        body = self.raw(f"/apis/{GROUP}/v1beta2/namespaces/{namespace}/pods/*/{metric}{query}")
        return {item["describedObject"]["name"]: _quantity(item["value"])
                for item in (body or {}).get("items", [])}

    def adapter_log(self, runtime: KubeletRuntime) -> str:
        pods = [key for key in runtime.workers if key[0] == NAMESPACE]
        return "\n".join(runtime.log_tail(ns, pod, 40) for ns, pod in pods) or "(no adapter pod)"

    def stop(self) -> None:
        self._stop.set()
        if self._discovery is not None:
            self._discovery.join(10)
        self.env.kubectl("delete", "apiservice", f"v1beta1.{GROUP}", f"v1beta2.{GROUP}",
                         "--ignore-not-found", check=False)
        self.env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        if self._prometheus is not None and self._prometheus.poll() is None:
            self._prometheus.send_signal(signal.SIGTERM)
            try:
                self._prometheus.wait(20)
            except subprocess.TimeoutExpired:
                self._prometheus.kill()
                self._prometheus.wait(10)
        if self._log is not None:
            self._log.close()


def _quantity(text: str) -> float:
    """A quantity the adapter writes ("0", "2", "1500m") as a number."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def start_prometheus(env: K8sEnv, runtime: KubeletRuntime, workdir: Path,
                     platform: bool = False) -> CustomMetrics:
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is missing: run `make system-deps`")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    sd_file = workdir / "servers.json"
    sd_file.write_text("[]")
    for job in PLATFORM_JOBS if platform else ():
        sd_file.with_name(f"{job}.json").write_text("[]")
    config.write_text(yaml.safe_dump(prometheus_config(sd_file, platform)))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True,
                           text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"promtool rejects {config}: {check.stdout}{check.stderr}")
    # On the pods' gateway: the adapter pod reaches it there (pods cannot reach 127.0.0.1).
    address = f"{runtime.host_ip}:{free_port()}"
    log = open(workdir / "prometheus.log", "ab")  # noqa: SIM115 (closed in stop)
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address={address}", "--log.level=warn"],
        # Dies with this process however it ends (SIGKILL too), as the control plane and pods do.
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    metrics = CustomMetrics(env, f"http://{address}", workdir, proc, log, platform=platform)
    metrics._discovery = threading.Thread(target=metrics.discover, args=(sd_file,), daemon=True)
    metrics._discovery.start()

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("prometheus exited: " + (workdir / "prometheus.log").read_text()[-2000:])
        try:
            import httpx

            return httpx.get(f"{metrics.prometheus_url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout=60, what="prometheus /-/ready")
    return metrics


def adapter_objects(prometheus_url: str, ca: PemPair) -> list[dict[str, Any]]:
    """prometheus-adapter as its upstream manifests deploy it, serving with a cert of ``ca``."""
    service_dns = f"{ADAPTER}.{NAMESPACE}.svc"
    serving = issue_cert(ca, ADAPTER, server_names=(service_dns, f"{ADAPTER}.{NAMESPACE}"))
    labels = {"app.kubernetes.io/name": ADAPTER}
    meta = {"name": ADAPTER, "namespace": NAMESPACE, "labels": labels}
    subject = [{"kind": "ServiceAccount", "name": ADAPTER, "namespace": NAMESPACE}]
    container = {
        "name": ADAPTER,
        "image": ADAPTER_IMAGE,
        "command": ["/adapter"],
        "args": [
            f"--secure-port={ADAPTER_PORT}",
            "--tls-cert-file=/var/run/serving-cert/tls.crt",
            "--tls-private-key-file=/var/run/serving-cert/tls.key",
            "--config=/etc/adapter/config.yaml",
            f"--prometheus-url={prometheus_url}/",
            f"--metrics-relist-interval={RELIST_INTERVAL_S}s",
            "--v=2",
        ],
        "ports": [{"name": "https", "containerPort": ADAPTER_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "https"}, "periodSeconds": 1},
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/adapter", "readOnly": True},
            {"name": "serving-cert", "mountPath": "/var/run/serving-cert", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    api_services = [{
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": f"{version}.{GROUP}", "labels": labels},
        "spec": {"group": GROUP, "version": version, "groupPriorityMinimum": 100,
                 "versionPriority": priority, "caBundle": base64.b64encode(ca.cert).decode(),
                 "service": {"name": ADAPTER, "namespace": NAMESPACE, "port": 443}},
    } for version, priority in (("v1beta1", 100), ("v1beta2", 200))]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        # Delegated authn/authz: TokenReviews and SubjectAccessReviews...
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{ADAPTER}:system:auth-delegator"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:auth-delegator"}, "subjects": subject},
        # ...and the requestheader CA kube-apiserver publishes for extension servers.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": f"{ADAPTER}-auth-reader", "namespace": "kube-system"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"}, "subjects": subject},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"{ADAPTER}-resource-reader"},
         "rules": [{"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{ADAPTER}-resource-reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": f"{ADAPTER}-resource-reader"}, "subjects": subject},
        # The HPA controller's own identity may read the API (with
        # --use-service-account-credentials it is not the controller-manager's admin cert).
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "custom-metrics-reader"},
         "rules": [{"apiGroups": [GROUP], "resources": ["*"], "verbs": ["get", "list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "hpa-controller-custom-metrics"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "custom-metrics-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler",
                       "namespace": "kube-system"}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{ADAPTER}-config",
                                                              "namespace": NAMESPACE},
         "data": {"config.yaml": yaml.safe_dump(adapter_rules())}},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
         "metadata": {"name": f"{ADAPTER}-tls", "namespace": NAMESPACE},
         "data": {"tls.crt": base64.b64encode(serving.cert).decode(),
                  "tls.key": base64.b64encode(serving.key).decode()}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": ADAPTER, "containers": [container],
                "volumes": [{"name": "config", "configMap": {"name": f"{ADAPTER}-config"}},
                            {"name": "serving-cert", "secret": {"secretName": f"{ADAPTER}-tls"}},
                            {"name": "tmp", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
            "selector": labels, "ports": [{"name": "https", "port": 443, "targetPort": "https"}]}},
        *api_services,
    ]


def api_available(env: K8sEnv) -> bool:
    """Both APIServices report Available (kube-apiserver reached the adapter's discovery)."""
    for version in ("v1beta1", "v1beta2"):
        proc = env.kubectl("get", "apiservice", f"{version}.{GROUP}", "-o", "json", check=False)
        if proc.returncode != 0:
            return False
        conditions = json.loads(proc.stdout).get("status", {}).get("conditions", [])
        if not any(c["type"] == "Available" and c["status"] == "True" for c in conditions):
            return False
    return True


def start_custom_metrics(env: K8sEnv, runtime: KubeletRuntime, workdir: Path,
                         adapter_binary: Path, timeout: float = 180,
                         platform: bool = False) -> CustomMetrics:
    """Prometheus on the host, prometheus-adapter as a pod, the APIServices Available;
    ``platform``: Prometheus also scrapes the routers and the operator (for the dashboards)."""
    runtime.images["prometheus-adapter"] = Image({"/adapter": str(adapter_binary)})
    metrics = start_prometheus(env, runtime, workdir, platform)
    try:
        pki = env.workdir / "pki"
        ca = PemPair((pki / "ca.crt").read_bytes(), (pki / "ca.key").read_bytes())
        metrics.objects = adapter_objects(metrics.prometheus_url, ca)
        env.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in metrics.objects))
        deadline = time.monotonic() + timeout
        while not api_available(env):
            if time.monotonic() > deadline:
                status = env.kubectl("get", "apiservice", f"v1beta2.{GROUP}", "-o", "yaml",
                                     check=False).stdout
                raise RuntimeError(f"custom.metrics.k8s.io never became Available:\n{status}\n"
                                   f"adapter:\n{metrics.adapter_log(runtime)}")
            time.sleep(1)
    except BaseException:
        metrics.stop()
        raise
    return metrics


__all__ = ["ADAPTER", "GROUP", "NAMESPACE", "CustomMetrics", "adapter_objects", "api_available",
           "pod_targets", "prometheus_config", "server_targets", "start_custom_metrics",
           "start_prometheus"]
