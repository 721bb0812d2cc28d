"""A real, local Kubernetes control plane for tests and for trying the operator.

etcd, kube-apiserver (TLS, RBAC, service-account keys), kube-controller-manager,
kube-scheduler and kwok run as background processes on loopback, with one fake
GPU node that kwok keeps Ready. Pods scheduled there run no containers: kwok
marks them Running and Ready, which is all the operator can observe anyway.

    PYTHONPATH=tests/cluster python -m testenv up|down|status   (make k8s-env / k8s-env-down)

The pytest fixtures call `start_env` / `stop_env` with the same code.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvscale.processes import die_with_parent, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
BINS_SCRIPT = REPO_ROOT / "tools" / "k8s-bins.sh"
ADAPTER_SCRIPT = REPO_ROOT / "tools" / "prometheus-adapter.sh"

# Start order; stopped in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
REQUIRED_BINS = (*COMPONENTS, "kubectl")

FAKE_NODE_NAME = "kwok-gpu-0"
FAKE_NODE_GPUS = 8
# An untainted node without GPUs: where routers, Redis and other CPU pods land, as in a real
# cluster with a CPU pool beside the GPU nodes.
CPU_NODE_NAME = "kwok-cpu-0"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"
# Loopback (kwok's pods are never dialled through a Service); with process pods, a /24 of
# 198.18.128.0/17 instead (below). The first address is the `kubernetes` Service's.
# Each environment takes its own /24 in 127.245.0.0/16 (and, with process pods, its own pair of
# /24s in 198.18.0.0/16): two test sessions on one machine must not listen on each other's
# Service addresses. The defaults are what `up` uses.
SERVICE_CIDR = "127.245.0.0/24"
KUBERNETES_SERVICE_IP = "127.245.0.1"
# kwok gives its pods and node addresses from these ranges. They are loopback on purpose: the
# operator scrapes pod IPs, and a test must never send traffic off this machine (a scrape of a
# kwok pod without a metrics-url override is refused at once instead of leaving the host).
POD_CIDR = "127.244.0.0/16"
# Pods the process runtime runs get addresses here instead: the apiserver refuses loopback
# addresses in EndpointSlices, so their slices would stay empty. 198.18.0.0/15 is reserved for
# network benchmarks (RFC 2544) and never routed, so nothing sent there leaves the machine.
# An environment with process pods takes 198.18.N.0/24 for its pods (each in a network namespace
# of its own on a bridge holding 198.18.N.1, tests/cluster/pod_network.py) and 198.18.128+N.0/24
# for its Services: not 127/8, which a pod's namespace cannot reach through its veth.
PROCESS_POD_CIDR = "198.18.0.0/16"
PROCESS_SUBNETS = 128
# What an older version of this file routed to lo: it would take every pod address for the
# host's own, so the pods' namespaces would be unreachable. Removed when found.
LEGACY_LOCAL_ROUTE = ("local", "198.18.0.0/16", "dev", "lo", "table", "local")
FAKE_NODE_IP = "127.240.0.10"
# kwok with this Stage plays no pod lifecycle at all (a Stage given for Pods replaces kwok's
# default ones, and this one never matches): the process runtime does it instead.
KWOK_NO_POD_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pods-left-to-the-process-runtime
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
      - key: '.metadata.annotations["kvscale.io/never"]'
        operator: Exists
  next:
    delete: false
"""

STARTUP_TIMEOUT_S = 180.0
# The client cert kube-apiserver presents to aggregated API servers (kubeadm's name for it).
FRONT_PROXY_CLIENT = "front-proxy-client"
# The HPA controller's reconcile period here (kube-controller-manager's default is 15 s).
HPA_SYNC_PERIOD_S = 2

# Processes this interpreter started, by pid: their liveness comes from
# Popen.poll(), which also reaps them. (Right after exec, /proc/PID/cmdline can
# still read empty, so the cmdline check is only for processes someone else
# started, as in `down` after `up`.)
_children: dict[int, subprocess.Popen] = {}


class K8sEnvError(RuntimeError):
    """The control plane could not be built, started or reached."""


# --------------------------------------------------------------------------- binaries


def find_or_build_bins() -> Path:
    """The folder holding the control-plane binaries, building them if needed.

    tools/k8s-bins.sh honours KUBEBUILDER_ASSETS and its own cache, so this is
    instant after the first build.
    """
    if not BINS_SCRIPT.is_file():
        raise K8sEnvError(f"{BINS_SCRIPT} not found (run from a kvscale checkout)")
    proc = subprocess.run(
        ["bash", str(BINS_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise K8sEnvError(f"{BINS_SCRIPT} failed with exit code {proc.returncode}")
    bins = Path(lines[-1])
    check_bins(bins)
    return bins


def find_or_build_prometheus_adapter() -> Path:
    """prometheus-adapter (tools/prometheus-adapter.sh: built from Go modules and cached like the
    control plane; KVSCALE_PROMETHEUS_ADAPTER names one of your own). Raises when it cannot be
    had: the tests that need it fail, they never skip."""
    proc = subprocess.run(["bash", str(ADAPTER_SCRIPT)], stdout=subprocess.PIPE, stderr=None,
                          text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise K8sEnvError(f"{ADAPTER_SCRIPT} failed with exit code {proc.returncode}")
    binary = Path(lines[-1])
    if not os.access(binary, os.X_OK):
        raise K8sEnvError(f"{ADAPTER_SCRIPT} printed {binary}, which is not an executable")
    return binary


def check_bins(bins: Path) -> None:
    missing = [name for name in COMPONENTS if not os.access(bins / name, os.X_OK)]
    if missing:
        raise K8sEnvError(f"{bins} lacks {', '.join(missing)}")
    if kubectl_path(bins) is None:
        raise K8sEnvError(f"no kubectl in {bins} nor on PATH")


def kubectl_path(bins: Path) -> str | None:
    # The one built with the apiserver matches its version; else the machine's.
    own = bins / "kubectl"
    return str(own) if os.access(own, os.X_OK) else shutil.which("kubectl")


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class PemPair:
    cert: bytes
    key: bytes


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    # P-256: instant to generate, and every component here accepts it.
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def make_ca(common_name: str = "kvscale-testenv-ca") -> PemPair:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return PemPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: PemPair,
    common_name: str,
    organizations: tuple[str, ...] = (),
    *,
    server_names: tuple[str, ...] = (),
    server_ips: tuple[str, ...] = (),
) -> PemPair:
    """A leaf certificate signed by `ca`: a server cert when names/IPs are given,
    else a client cert whose CN/O the apiserver reads as user/groups."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    is_server = bool(server_names or server_ips)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
            critical=False,
        )
    )
    if is_server:
        alt_names = [x509.DNSName(n) for n in server_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return PemPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_signing_key_pair() -> PemPair:
    """Service-account token keys: (public key PEM, private key PEM)."""
    from cryptography.hazmat.primitives import serialization

    key = _new_key()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return PemPair(public, _key_pem(key))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig_yaml(server: str, ca_pem: bytes, user: str, credentials: dict[str, str]) -> str:
    import yaml

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kvscale-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "kvscale-test", "user": user}}],
        "current-context": user,
    }
    return yaml.safe_dump(config, sort_keys=False)


def _write_private(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(raw)
    return path


# --------------------------------------------------------------------------- the environment


@dataclass
class K8sEnv:
    """A running control plane: where it lives and how to talk to it."""

    workdir: Path
    bins: Path
    server: str  # https://127.0.0.1:PORT
    kubeconfig: Path  # admin (system:masters)
    # True: kwok leaves pods alone and tests/cluster/kubelet.py runs them as processes.
    process_pods: bool = False
    service_cidr: str = SERVICE_CIDR
    pod_cidr: str = PROCESS_POD_CIDR  # where the process runtime gives its pods addresses
    hpa_sync_period_s: int = HPA_SYNC_PERIOD_S  # the HPA controller's period here

    @property
    def kubernetes_service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the first address of the service CIDR."""
        import ipaddress

        return str(ipaddress.ip_network(self.service_cidr)[1])
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def ca_cert(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def kubectl_bin(self) -> str:
        path = kubectl_path(self.bins)
        if path is None:
            raise K8sEnvError("kubectl not found")
        return path

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster (admin unless `kubeconfig`)."""
        cmd = [self.kubectl_bin, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise K8sEnvError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Until the CRD serves. Not `kubectl wait --for=condition=Established`: that fails at once
        on a CRD the apiserver has not given a status yet ("<nil> ... expected []interface{}")."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.kubectl_json("get", "crd", crd).get("status") or {}
            if any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in status.get("conditions") or []):
                return
            if time.monotonic() > deadline:
                raise K8sEnvError(f"crd/{crd} not Established after {timeout:g} s: {status}")
            time.sleep(0.2)

    def kubeconfig_for_user(self, username: str, groups: tuple[str, ...] | list[str] = ()) -> Path:
        """A kubeconfig authenticating as `username` in `groups` via a client cert.

        `system:serviceaccount:<ns>:<name>` with groups `system:serviceaccounts`
        and `system:serviceaccounts:<ns>` is that service account as far as RBAC
        is concerned, so the operator can be tested under exactly its Role.
        """
        pki = self.workdir / "pki"
        ca = PemPair((pki / "ca.crt").read_bytes(), (pki / "ca.key").read_bytes())
        leaf = issue_cert(ca, username, tuple(groups))
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", username)
        credentials = {
            "client-certificate-data": _b64(leaf.cert),
            "client-key-data": _b64(leaf.key),
        }
        text = kubeconfig_yaml(self.server, ca.cert, username, credentials)
        return _write_private(self.workdir / "users" / f"{slug}.kubeconfig", text)

    def kubeconfig_for_service_account(self, namespace: str, name: str) -> Path:
        """Client-cert identity of service account `namespace/name` (it need not exist)."""
        return self.kubeconfig_for_user(
            f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
        )

    def kubeconfig_with_token(self, namespace: str, name: str, duration: str = "2h") -> Path:
        """Kubeconfig with a real bound token for an existing service account
        (TokenRequest API, signed with the environment's service-account key)."""
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()
        text = kubeconfig_yaml(
            self.server,
            self.ca_cert.read_bytes(),
            f"system:serviceaccount:{namespace}:{name}",
            {"token": token},
        )
        return _write_private(self.workdir / "users" / f"token-{namespace}-{name}.kubeconfig", text)

    def log_path(self, component: str) -> Path:
        return self.workdir / "logs" / f"{component}.log"

    def save(self) -> None:
        state = asdict(self)
        state.update(
            workdir=str(self.workdir), bins=str(self.bins), kubeconfig=str(self.kubeconfig)
        )
        (self.workdir / "env.json").write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, workdir: Path) -> K8sEnv:
        state = json.loads((workdir / "env.json").read_text())
        return cls(
            workdir=Path(state["workdir"]),
            bins=Path(state["bins"]),
            server=state["server"],
            kubeconfig=Path(state["kubeconfig"]),
            ports={k: int(v) for k, v in state["ports"].items()},
            pids={k: int(v) for k, v in state["pids"].items()},
            process_pods=bool(state.get("process_pods", False)),
            service_cidr=state.get("service_cidr", SERVICE_CIDR),
            pod_cidr=state.get("pod_cidr", PROCESS_POD_CIDR),
            hpa_sync_period_s=int(state.get("hpa_sync_period_s", HPA_SYNC_PERIOD_S)),
        )


def _spawn(env: K8sEnv, component: str, args: list[str], tie_to_parent: bool) -> None:
    log_path = env.log_path(component)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(env.bins / component), *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=env.workdir,
            start_new_session=True,  # Ctrl-C in the terminal that ran `up` leaves it alone
            preexec_fn=die_with_parent if tie_to_parent else None,
        )
    _children[proc.pid] = proc
    env.pids[component] = proc.pid
    (env.workdir / "pids").mkdir(exist_ok=True)
    (env.workdir / "pids" / f"{component}.pid").write_text(f"{proc.pid}\n")
    env.save()


def _alive(pid: int, binary: Path) -> bool:
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    return _is_ours(pid, binary)


def _is_ours(pid: int, binary: Path) -> bool:
    """True when `pid` is alive and still runs `binary` (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        return False
    return bool(cmdline) and cmdline[0] == str(binary).encode()


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _wait_until(what: str, probe, timeout: float, env: K8sEnv, component: str) -> None:
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        pid = env.pids.get(component)
        if pid is not None and not _alive(pid, env.bins / component):
            raise K8sEnvError(
                f"{component} exited while waiting for {what}; "
                f"{env.log_path(component)}:\n{_log_tail(env.log_path(component))}"
            )
        try:
            if probe():
                return
        except Exception as exc:  # noqa: BLE001 -- any failure means "not yet"
            last_error = str(exc)
        time.sleep(0.5)
    raise K8sEnvError(
        f"timed out after {timeout:.0f}s waiting for {what} ({last_error}); "
        f"{env.log_path(component)}:\n{_log_tail(env.log_path(component))}"
    )


def _http_ok(url: str, context: ssl.SSLContext | None = None, expect: bytes = b"ok") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            body = resp.read()
            return resp.status == 200 and expect in body
    except (urllib.error.URLError, OSError):
        return False


def _admin_tls(workdir: Path) -> ssl.SSLContext:
    pki = workdir / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


def _insecure_tls() -> ssl.SSLContext:
    # The controller-manager and scheduler self-sign their health endpoint.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _write_pki(workdir: Path, kubernetes_service_ip: str = KUBERNETES_SERVICE_IP) -> None:
    pki = workdir / "pki"
    ca = make_ca()
    serving = issue_cert(
        ca,
        "kube-apiserver",
        server_names=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        server_ips=("127.0.0.1", kubernetes_service_ip),
    )
    admin = issue_cert(ca, "admin", ("system:masters",))
    service_accounts = make_signing_key_pair()
    # The aggregation layer (custom.metrics.k8s.io served by prometheus-adapter): kube-apiserver
    # proxies to an extension API server with this client cert, and the extension trusts the
    # X-Remote-User headers only from a cert of this CA, as kubeadm sets it up.
    front_proxy_ca = make_ca("kvscale-testenv-front-proxy-ca")
    front_proxy_client = issue_cert(front_proxy_ca, FRONT_PROXY_CLIENT)
    for name, pair in (("ca", ca), ("apiserver", serving), ("admin", admin),
                       ("front-proxy-ca", front_proxy_ca), ("front-proxy-client", front_proxy_client)):
        _write_private(pki / f"{name}.crt", pair.cert)
        _write_private(pki / f"{name}.key", pair.key)
    _write_private(pki / "sa.pub", service_accounts.cert)
    _write_private(pki / "sa.key", service_accounts.key)


def fake_gpu_node_manifest(name: str = FAKE_NODE_NAME, gpus: int = FAKE_NODE_GPUS) -> dict:
    """A Node kwok adopts (by its annotation) and keeps Ready, offering `gpus` GPUs."""
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {
            "taints": [
                {"key": KWOK_NODE_ANNOTATION, "value": KWOK_NODE_VALUE, "effect": "NoSchedule"}
            ]
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def cpu_node_manifest(name: str = CPU_NODE_NAME) -> dict:
    """An untainted kwok node with no GPUs."""
    node = fake_gpu_node_manifest(name, gpus=0)
    resources = {key: value for key, value in node["status"]["capacity"].items()
                 if key != "nvidia.com/gpu"}
    node["metadata"]["labels"] = {key: value for key, value in node["metadata"]["labels"].items()
                                  if not key.startswith("nvidia.com/")}
    node["metadata"]["labels"]["type"] = "kwok-cpu"
    node["spec"] = {}
    node["status"] = {"capacity": resources, "allocatable": resources}
    return node


def kwok_toleration() -> dict:
    """The toleration a pod needs to land on the fake node."""
    return {
        "key": KWOK_NODE_ANNOTATION,
        "operator": "Equal",
        "value": KWOK_NODE_VALUE,
        "effect": "NoSchedule",
    }


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def process_pod_subnets() -> tuple[str, str]:
    """(pod CIDR, service CIDR) for an environment with process pods: a pair of /24s of
    198.18.0.0/16 that no interface or route of this machine uses yet (another session's)."""
    if os.geteuid() != 0:
        raise K8sEnvError("process pods need root: the runtime makes a network namespace per pod")
    legacy = _ip("route", "show", "table", "local", "type", "local", "198.18.0.0/16")
    if "198.18.0.0/16" in legacy.stdout:
        _ip("route", "del", *LEGACY_LOCAL_ROUTE)
    used = _ip("-o", "-4", "addr", "show").stdout + _ip("route", "show", "table", "all").stdout
    links = _ip("-o", "link", "show").stdout
    free = [n for n in range(PROCESS_SUBNETS)
            if f"198.18.{n}." not in used and f"198.18.{n + PROCESS_SUBNETS}." not in used
            and f" kvpodbr{n}:" not in links]  # tests/cluster/pod_network.py's bridge
    if not free:
        raise K8sEnvError("every 198.18.N.0/24 is in use: leftover bridges? (`ip -br addr`)")
    n = random.choice(free)
    return f"198.18.{n}.0/24", f"198.18.{n + PROCESS_SUBNETS}.0/24"


def start_env(
    workdir: Path,
    bins: Path,
    *,
    tie_to_parent: bool = True,
    timeout: float = STARTUP_TIMEOUT_S,
    process_pods: bool = False,
    hpa_sync_period_s: int = HPA_SYNC_PERIOD_S,
) -> K8sEnv:
    """Start a fresh control plane under `workdir` and return once the fake
    nodes are Ready. `tie_to_parent`: the processes die with this one (tests);
    `up` passes False so they outlive the command. `process_pods`: kwok does not
    play pods; start tests/cluster/kubelet.py's runtime to run them.
    `hpa_sync_period_s`: the HPA controller's period (a benchmark wants a cluster's 15 s)."""
    check_bins(bins)
    workdir = workdir.resolve()
    if (workdir / "env.json").exists():
        raise K8sEnvError(f"{workdir} already holds an environment; stop it first")
    workdir.mkdir(parents=True, exist_ok=True)
    subnet = random.randrange(256)
    service_cidr, pod_cidr = f"127.245.{subnet}.0/24", f"198.18.{subnet}.0/24"
    if process_pods:
        pod_cidr, service_cidr = process_pod_subnets()
    _write_pki(workdir, str(ipaddress.ip_network(service_cidr)[1]))
    pki = workdir / "pki"
    ports = {
        name: free_port()
        for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
    }
    server = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = workdir / "kubeconfig"
    _write_private(
        kubeconfig,
        kubeconfig_yaml(
            server,
            (pki / "ca.crt").read_bytes(),
            "admin",
            {
                "client-certificate-data": _b64((pki / "admin.crt").read_bytes()),
                "client-key-data": _b64((pki / "admin.key").read_bytes()),
            },
        ),
    )
    env = K8sEnv(
        workdir=workdir, bins=bins.resolve(), server=server, kubeconfig=kubeconfig, ports=ports,
        process_pods=process_pods, service_cidr=service_cidr, pod_cidr=pod_cidr,
        hpa_sync_period_s=hpa_sync_period_s,
    )
    env.save()
    try:
        _start_components(env, tie_to_parent, timeout)
    except BaseException:
        stop_env(env, keep_logs=True)
        raise
    return env


def _start_components(env: K8sEnv, tie_to_parent: bool, timeout: float) -> None:
    pki = env.workdir / "pki"
    ports = env.ports
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
    _spawn(
        env,
        "etcd",
        [
            "--name=default",
            f"--data-dir={env.workdir / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--unsafe-no-fsync",  # throwaway data; fsync dominates on a loaded disk
            "--log-level=warn",
        ],
        tie_to_parent,
    )
    _wait_until(
        "etcd /health",
        lambda: _http_ok(f"{etcd_url}/health", expect=b'"health":"true"'),
        timeout,
        env,
        "etcd",
    )

    _spawn(
        env,
        "kube-apiserver",
        [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={env.service_cidr}",
            "--allow-privileged=true",
            f"--service-account-issuer={env.server}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # The Endpoints of the `kubernetes` Service would point at loopback,
            # which Endpoints validation rejects; nothing here needs them.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            # The aggregation layer: what kube-apiserver sends extension API servers (the
            # custom-metrics adapter) and which client cert they must accept it from.
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        ],
        tie_to_parent,
    )
    admin_tls = _admin_tls(env.workdir)
    _wait_until(
        "kube-apiserver /readyz",
        lambda: _http_ok(f"{env.server}/readyz", admin_tls),
        timeout,
        env,
        "kube-apiserver",
    )

    kubeconfig = str(env.kubeconfig)
    delegated = [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
    ]
    _spawn(
        env,
        "kube-controller-manager",
        [
            *delegated,
            f"--secure-port={ports['controller-manager']}",
            "--controllers=*",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={env.service_cidr}",
            # The HPA controller (on with `*`) reconciles every 15 s by default: shortened here
            # only, so a test sees a few HPA decisions within a minute.
            f"--horizontal-pod-autoscaler-sync-period={env.hpa_sync_period_s}s",
        ],
        tie_to_parent,
    )
    _spawn(
        env,
        "kube-scheduler",
        [*delegated, f"--secure-port={ports['scheduler']}"],
        tie_to_parent,
    )
    _spawn(
        env,
        "kwok",
        [
            f"--kubeconfig={kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
            f"--cidr={POD_CIDR}",
            f"--node-ip={FAKE_NODE_IP}",
            f"--server-address=127.0.0.1:{ports['kwok']}",
            # Without a node lease kwok refreshes the node's heartbeat only about once a minute,
            # past the controller-manager's 50 s grace period: the node (and every pod on it)
            # would flap NotReady mid-test.
            "--node-lease-duration-seconds=40",
            *([f"--config={_write_private(env.workdir / 'kwok-stages.yaml', KWOK_NO_POD_STAGES)}"]
              if env.process_pods else []),
        ],
        tie_to_parent,
    )
    insecure = _insecure_tls()
    for component, port_name in (
        ("kube-controller-manager", "controller-manager"),
        ("kube-scheduler", "scheduler"),
    ):
        _wait_until(
            f"{component} /healthz",
            lambda p=ports[port_name]: _http_ok(f"https://127.0.0.1:{p}/healthz", insecure),
            timeout,
            env,
            component,
        )
    _wait_until(
        "kwok /healthz",
        lambda: _http_ok(f"http://127.0.0.1:{ports['kwok']}/healthz"),
        timeout,
        env,
        "kwok",
    )
    # Pods are refused until the controller-manager made the namespace's
    # `default` ServiceAccount; wait so that the first test doesn't race it.
    _wait_until(
        "the default ServiceAccount",
        lambda: (
            env.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode
            == 0
        ),
        timeout,
        env,
        "kube-controller-manager",
    )
    for node in (fake_gpu_node_manifest(), cpu_node_manifest()):
        env.kubectl("apply", "-f", "-", input=json.dumps(node))
    for node_name in (FAKE_NODE_NAME, CPU_NODE_NAME):
        _wait_until(
            f"node {node_name} Ready",
            lambda n=node_name: _node_ready(env, n),
            timeout,
            env,
            "kwok",
        )


def _node_ready(env: K8sEnv, name: str) -> bool:
    node = env.kubectl_json("get", "node", name)
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", [])
    )
    # The node lifecycle controller lifts its not-ready taint a moment after Ready.
    not_ready_taint = any(
        t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints", [])
    )
    return ready and not not_ready_taint


def ready_pods(env: K8sEnv, namespace: str, selector: str) -> list[dict]:
    """The pods of ``selector`` in ``namespace`` that say Ready and are not being deleted (a pod
    on its way out may still say Ready for a moment: nothing should be sent to it)."""
    return [p for p in env.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions") or [])]


def stop_env(env: K8sEnv, *, keep_logs: bool = False, grace: float = 10.0) -> None:
    """Stop every component (TERM, then KILL after `grace`) and delete the
    workdir, or all of it but logs/ when `keep_logs` (they help after a failure)."""
    for component in reversed(COMPONENTS):
        pid = env.pids.get(component)
        if pid is not None and _alive(pid, env.bins / component):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for component in reversed(COMPONENTS):
        pid = env.pids.get(component)
        if pid is None:
            continue
        while _alive(pid, env.bins / component) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid, env.bins / component):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child = _children.pop(pid, None)
        if child is not None:
            child.wait()
        else:
            # Not our child (`down` after `up`): give init a moment to reap it.
            reaped_by = time.monotonic() + 5
            while _is_ours(pid, env.bins / component) and time.monotonic() < reaped_by:
                time.sleep(0.05)
    env.pids.clear()
    if not keep_logs:
        shutil.rmtree(env.workdir, ignore_errors=True)
    elif env.workdir.exists():
        for entry in env.workdir.iterdir():
            if entry.name == "logs":
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def status(env: K8sEnv) -> dict[str, bool]:
    """Which components are alive, plus the apiserver's readiness."""
    alive = {c: _alive(env.pids.get(c, -1), env.bins / c) for c in COMPONENTS}
    alive["apiserver-ready"] = alive["kube-apiserver"] and _http_ok(
        f"{env.server}/readyz", _admin_tls(env.workdir)
    )
    return alive


# --------------------------------------------------------------------------- CLI


def _default_workdir() -> Path:
    return Path.cwd() / ".k8s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testenv",
        description="A local Kubernetes control plane (etcd, kube-apiserver, controller-manager, "
        "scheduler, kwok with a fake GPU node) for trying the operator.",
    )
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="state, logs and kubeconfig (default: ./.k8s)",
    )
    parser.add_argument(
        "--bins",
        type=Path,
        default=None,
        help="folder with the binaries (default: built or found by tools/k8s-bins.sh)",
    )
    args = parser.parse_args(argv)
    workdir = (args.workdir or _default_workdir()).resolve()
    state = workdir / "env.json"

    if args.action == "up":
        if state.exists():
            env = K8sEnv.load(workdir)
            if all(status(env).values()):
                print(f"already up: export KUBECONFIG={env.kubeconfig}")
                return 0
            print("stale environment found; cleaning it up", file=sys.stderr)
            stop_env(env)
        bins = args.bins or find_or_build_bins()
        started = time.monotonic()
        try:
            env = start_env(workdir, bins, tie_to_parent=False)
        except K8sEnvError as exc:
            print(f"error: {exc}\nlogs: {workdir / 'logs'}", file=sys.stderr)
            return 1
        print(
            f"kube-apiserver {env.server} up in {time.monotonic() - started:.1f}s, "
            f"fake GPU node {FAKE_NODE_NAME} Ready\n"
            f"  export KUBECONFIG={env.kubeconfig}\n"
            f"  kubectl get nodes\n"
            f"logs in {workdir / 'logs'}; stop with `make k8s-env-down`"
        )
        return 0

    if not state.exists():
        print(f"no environment in {workdir}")
        return 0 if args.action == "down" else 1
    env = K8sEnv.load(workdir)
    if args.action == "down":
        stop_env(env)
        print(f"stopped and removed {workdir}")
        return 0
    report = status(env)
    for name, ok in report.items():
        pid = env.pids.get(name, "")
        print(f"{name:24} {'up' if ok else 'DOWN'} {pid}")
    print(f"KUBECONFIG={env.kubeconfig}")
    return 0 if all(report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
