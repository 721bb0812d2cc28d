"""A real node for tests: pods as containers under a real kubelet, on this machine only.

Beside a control plane of its own (etcd, kube-apiserver, controller-manager, scheduler from
tools/k8s-bins.sh) it runs containerd and runc from Debian, the Debian CNI plugins (a bridge,
host-local addresses), kubelet, kube-proxy (iptables) and CoreDNS (tools/node-bins.sh, the same
Kubernetes release as the apiserver), and imports kvscale's images into containerd without a registry.

Images are the one thing kept between runs (IMAGE_CACHE, outside BASE): an OCI layout per image
(`podman save` into it writes only changed layers) and containerd's root (content metadata and
the unpacked snapshots), so a rebuilt engine image costs an import of its changed top layers,
not of its 7 GB. Everything else a run makes is in BASE and goes at stop; containerd's root is
handed over only after a clean stop removed every container, task, lease and working snapshot
(IMAGE_CACHE_CLEAN), and is wiped for a full import otherwise.

The pod network is dual-stack with IPv6 first, as on a single-stack IPv6 cluster's nodes: a
pod's `status.podIP`, the address a server advertises and the one the router discovers in an
EndpointSlice are IPv6, and Services get IPv6 cluster IPs (the same code must also work with
IPv4, which the process runtime under tests/cluster covers). Addresses stay inside the machine:
everything lives in 198.19.0.0/16 (RFC 2544, never routed) and fd19:19::/48 (a unique local
prefix of our own). The node's own addresses are on lo; pods get routes to those two ranges via
the bridge and no default route, so nothing a pod sends can leave; nothing is masqueraded but
Service traffic from outside the pod ranges.

One node environment per machine at a time (a lock): the names (bridge, cgroup, paths) are
fixed so that `sweep()` can find and remove what a killed run left behind: containers, shims,
mounts, network namespaces, the bridge, kube-proxy's rules, the cgroups, the node address.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from testenv import (
    PemPair,
    _b64,
    find_or_build_bins,
    issue_cert,
    kubeconfig_yaml,
    make_ca,
    make_signing_key_pair,
)

from kvscale.processes import die_with_parent, free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_BINS_SCRIPT = REPO_ROOT / "tools" / "node-bins.sh"
NODE_IMAGES_SCRIPT = REPO_ROOT / "tools" / "node-images.sh"
IMAGES_SCRIPT = REPO_ROOT / "tools" / "images.sh"

# Everything the node owns, at fixed places (see the module docstring).
BASE = Path("/var/tmp/kvscale-node")
LOCK = Path("/var/tmp/kvscale-node.lock")
# The machine's values of KUBELET_SYSCTLS before the node started: sweep() puts them back even
# after a killed run.
SYSCTLS_SAVED = Path("/var/tmp/kvscale-node.sysctls.json")
NODE_NAME = "kvs-node-0"
BRIDGE = "kvsnode0"
CGROUP_ROOT = "kvscale-node"
CGROUP_FS = Path("/sys/fs/cgroup")
# 198.19.0.0/16: pods in the first /24, Services in 198.19.128.0/24, the node on .255.1.
NODE_RANGE = "198.19.0.0/16"
POD_CIDR = "198.19.0.0/24"
POD_GATEWAY = "198.19.0.1"
SERVICE_CIDR = "198.19.128.0/24"
NODE_IP = "198.19.255.1"
# fd19:19::/48, laid out the same way; IPv6 is the cluster's first family, so the apiserver,
# the kubelet, CoreDNS and the `kubernetes` Service are on these addresses.
NODE_RANGE6 = "fd19:19::/48"
POD_CIDR6 = "fd19:19::/64"
POD_GATEWAY6 = "fd19:19::1"
SERVICE_CIDR6 = "fd19:19:0:80::/112"
KUBERNETES_SERVICE_IP6 = "fd19:19:0:80::1"
NODE_IP6 = "fd19:19:0:ff::1"
# Every list of two families below puts IPv6 first: the primary family.
NODE_ADDRESSES = (NODE_IP6, NODE_IP)
NODE_PREFIXES = (f"{NODE_IP6}/128", f"{NODE_IP}/32")
CLUSTER_DOMAIN = "cluster.local"
# The kubelet sets these at start unless protectKernelDefaults (then it refuses to start where
# they differ): the node puts the machine's values back when it stops.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
# The CNI bridge switches forwarding on for each family it serves (Service traffic between pods
# is routed through the node); the machine gets its own values back too.
SAVED_SYSCTLS = (*KUBELET_SYSCTLS, "net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding")
STARTUP_TIMEOUT_S = 180.0
# The image cache (see the module docstring; `rm -rf` it to drop it, with no node running):
#   oci/<repository>/  an OCI layout per image repository, for incremental `podman save`
#   containerd/        containerd's root: content store, overlayfs snapshots, meta.db
#   containerd.clean   written by a stop that left containerd's root holding images only;
#                      taken away when containerd starts on it, so a killed run's is wiped
IMAGE_CACHE = Path(os.environ.get("KVSCALE_NODE_IMAGE_CACHE")
                   or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "kvscale" / "node-images")
IMAGE_CACHE_OCI = IMAGE_CACHE / "oci"
CONTAINERD_ROOT = IMAGE_CACHE / "containerd"
IMAGE_CACHE_CLEAN = IMAGE_CACHE / "containerd.clean"
# Under containerd's root, what belongs to containers rather than images (the CRI's per-sandbox
# hosts/resolv.conf/shm, the shims' work folders): removed before every start.
CONTAINERD_ROOT_PER_CONTAINER = ("io.containerd.grpc.v1.cri", "io.containerd.runtime.v2.task",
                                 "io.containerd.runtime.v1.linux")


class NodeEnvError(RuntimeError):
    """The node could not be built, started or cleaned up."""


def run(*cmd: str, check: bool = True, input: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, input=input,
                          timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise NodeEnvError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _script_folder(script: Path) -> Path:
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeEnvError(f"{script.name} failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def find_or_build_node_bins() -> Path:
    return _script_folder(NODE_BINS_SCRIPT)


def _write(path: Path, data: str | bytes, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    path.chmod(mode)
    return path


@dataclass
class NodeEnv:
    """A running control plane with one real node: where it lives and how to talk to it."""

    k8s_bins: Path
    node_bins: Path
    logs: Path
    server: str = ""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    lock: IO[str] | None = None
    # Set by a stop that found containerd's root holding images only (see stop_node_env).
    cache_clean: bool = False

    @property
    def kubeconfig(self) -> Path:
        return BASE / "pki" / "admin.kubeconfig"

    @property
    def containerd_socket(self) -> Path:
        return BASE / "containerd" / "containerd.sock"

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(str(self.k8s_bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args,
                   check=check, input=input, timeout=timeout)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: dict | list[dict]) -> None:
        items = manifest if isinstance(manifest, list) else [manifest]
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": items}))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("ctr", "-a", str(self.containerd_socket), "-n", "k8s.io", *args, check=check)

    def log_tail(self, component: str, lines: int = 30) -> str:
        path = self.logs / f"{component}.log"
        if not path.exists():
            return f"(no {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ---------------------------------------------------------------- processes

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent, close_fds=True)
        log.close()
        self.processes[name] = proc
        return proc

    def wait_for(self, what: str, predicate: Callable[[], object], component: str,
                 timeout: float = STARTUP_TIMEOUT_S) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.processes.get(component)
            if proc is not None and proc.poll() is not None:
                raise NodeEnvError(f"{component} exited ({proc.returncode}) while waiting for "
                                   f"{what}:\n{self.log_tail(component)}")
            try:
                value = predicate()
            except (subprocess.SubprocessError, NodeEnvError, OSError, ValueError):
                value = None
            if value:
                return value
            time.sleep(0.5)
        raise NodeEnvError(f"timed out after {timeout:.0f}s waiting for {what}:\n"
                           f"{self.log_tail(component)}")


# -------------------------------------------------------------------- machine state


def _read_sysctls() -> dict[str, str]:
    return {name: (Path("/proc/sys") / name).read_text().strip() for name in SAVED_SYSCTLS}


def _restore_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = Path("/proc/sys") / name
        if path.read_text().strip() != value:
            path.write_text(value)


def _cgroup_dirs() -> list[Path]:
    """The node's cgroup in every v1 hierarchy (and the unified one, if mounted)."""
    return [h / CGROUP_ROOT for h in sorted(CGROUP_FS.iterdir()) if h.is_dir() and not h.is_symlink()
            and (h / "cgroup.procs").exists()]


def _make_cgroups() -> None:
    for path in _cgroup_dirs():
        path.mkdir(exist_ok=True)
        if path.parent.name == "cpuset":
            # A v1 cpuset child starts empty; no task can join it until it has cpus and mems.
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((path.parent / knob).read_text())


def _remove_cgroups() -> None:
    for root in _cgroup_dirs():
        if not root.exists():
            continue
        # Deepest first: a cgroup directory goes only once it has no children and no tasks.
        for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _rmdir_cgroup(path)
        _rmdir_cgroup(root)


def _rmdir_cgroup(path: Path) -> None:
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)  # its last task is still exiting
    raise NodeEnvError(f"cannot remove cgroup {path}: {(path / 'cgroup.procs').read_text()!r}")


def _our_pids() -> list[int]:
    """Processes this node started that are still around (a killed run's kubelet, containerd,
    shims: each names a path under BASE on its command line)."""
    marker = str(BASE).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target.startswith(prefix) or target == str(root):
            mounts.append(target)
    return mounts


def leftovers() -> list[str]:
    """What a node leaves on the machine; empty after a clean stop (the tests assert it)."""
    found = [f"process {pid}" for pid in _our_pids()]
    found += [f"mount {m}" for m in _mounts_under(BASE) + _mounts_under(CONTAINERD_ROOT)]
    if run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    veths = run("ip", "-o", "link", "show", "master", BRIDGE, check=False).stdout.strip()
    if veths:
        found.append(f"veths {veths}")
    on_lo = run("ip", "-o", "addr", "show", "dev", "lo").stdout
    found += [f"address {ip} on lo" for ip in NODE_ADDRESSES if f" {ip}/" in on_lo]
    found += [f"cgroup {p}" for p in _cgroup_dirs() if p.exists()]
    if SYSCTLS_SAVED.exists():
        found.append(f"sysctls not restored yet ({SYSCTLS_SAVED})")
    for tool in ("iptables-save", "ip6tables-save"):
        rules = run(tool, check=False).stdout
        found += [f"{tool}: {line}" for line in rules.splitlines()
                  if "KUBE-" in line or "198.19." in line or "fd19:19:" in line]
    if BASE.exists():
        found.append(f"folder {BASE}")
    return found


# Chains a kubelet makes when makeIPTablesUtilChains is on (it is off here, see kubelet_config);
# kube-proxy --cleanup does not know them. Only a kubelet makes KUBE-* chains on this machine.
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")


def _remove_kubelet_chains() -> None:
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            for chain in KUBELET_CHAINS:
                for parent in ("INPUT", "OUTPUT"):
                    while run(tool, "-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                        pass
                run(tool, "-t", table, "-F", chain, check=False)
                run(tool, "-t", table, "-X", chain, check=False)


def sweep(node_bins: Path | None) -> None:
    """Remove whatever a node left on the machine (a clean stop's last step; also run before a
    start, after a run that was killed)."""
    # Containers outlive containerd and their shims: stop them through runc itself (the shim
    # runs runc with --root <Root>/<containerd namespace>).
    for runc_root in sorted((BASE / "runc").glob("*")):
        listed = run("runc", "--root", str(runc_root), "list", "-q", check=False).stdout.split()
        for container in listed:
            run("runc", "--root", str(runc_root), "kill", container, "KILL", check=False)
        for container in listed:
            run("runc", "--root", str(runc_root), "delete", "--force", container, check=False)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _our_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            wait_until(lambda: not _our_pids(), 10, interval=0.1, what="the node's processes gone")
            break
        except TimeoutError:
            continue
    # Deepest first (a pod's volumes sit inside the kubelet's root, netns files in containerd's
    # state, a sandbox's /dev/shm in containerd's root, which is in the image cache).
    for target in sorted(_mounts_under(BASE) + _mounts_under(CONTAINERD_ROOT), key=len,
                         reverse=True):
        if run("umount", target, check=False).returncode != 0:
            run("umount", "-l", target, check=False)
    run("ip", "link", "delete", BRIDGE, check=False)
    proxy = (node_bins / "kube-proxy") if node_bins is not None else None
    if proxy is not None and proxy.exists():
        # Its own clean-up of every KUBE-* chain it made (iptables, and nftables if any).
        run(str(proxy), "--cleanup", check=False)
    _remove_kubelet_chains()
    # The shims' socket folder is containerd's default, whatever its state dir; ours is the
    # only containerd here, but only empty folders are removed.
    for folder in (Path("/run/containerd/s"), Path("/run/containerd")):
        try:
            folder.rmdir()
        except OSError:
            pass
    for prefix in NODE_PREFIXES:
        run("ip", "addr", "delete", prefix, "dev", "lo", check=False)
    _remove_cgroups()
    if SYSCTLS_SAVED.exists():
        _restore_sysctls(json.loads(SYSCTLS_SAVED.read_text()))
        SYSCTLS_SAVED.unlink()
    shutil.rmtree(BASE, ignore_errors=True)


# -------------------------------------------------------------------- configuration


def _pki(env: NodeEnv) -> None:
    pki = BASE / "pki"
    ca = make_ca("kvscale-node-ca")
    certs: dict[str, PemPair] = {
        "ca": ca,
        "apiserver": issue_cert(
            ca, "kube-apiserver",
            server_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                          f"kubernetes.default.svc.{CLUSTER_DOMAIN}"),
            server_ips=("127.0.0.1", *NODE_ADDRESSES, KUBERNETES_SERVICE_IP6)),
        # What the apiserver shows the kubelet for exec, logs and port-forward.
        "apiserver-kubelet-client": issue_cert(ca, "kube-apiserver-kubelet-client", ("system:masters",)),
        # The kubelet's serving cert, which the apiserver checks (--kubelet-certificate-authority).
        "kubelet-serving": issue_cert(ca, NODE_NAME, server_names=(NODE_NAME,), server_ips=NODE_ADDRESSES),
    }
    for name, pair in certs.items():
        _write(pki / f"{name}.crt", pair.cert)
        _write(pki / f"{name}.key", pair.key)
    sa = make_signing_key_pair()
    _write(pki / "sa.pub", sa.cert)
    _write(pki / "sa.key", sa.key)
    # Client identities: the admin, and each node component as itself (RBAC's built-in roles
    # system:node, system:node-proxier; CoreDNS gets its own ClusterRole below).
    for file, user, groups in (
        ("admin", "admin", ("system:masters",)),
        ("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",)),
        ("kube-proxy", "system:kube-proxy", ()),
        ("coredns", "system:kvscale-node:coredns", ()),
    ):
        pair = issue_cert(ca, user, groups)
        _write(pki / f"{file}.kubeconfig", kubeconfig_yaml(
            env.server, ca.cert, user,
            {"client-certificate-data": _b64(pair.cert), "client-key-data": _b64(pair.key)}))


CLUSTER_RBAC = [
    # The kubelet's client cert says group system:nodes; RBAC's system:node role has no
    # subjects by default (the Node authorizer normally does this job).
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "kvscale-node:system:node"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": "kvscale-node:coredns"},
     "rules": [{"apiGroups": [""], "resources": ["services", "namespaces", "pods"],
                "verbs": ["list", "watch"]},
               {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                "verbs": ["list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "kvscale-node:coredns"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                 "name": "kvscale-node:coredns"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                   "name": "system:kvscale-node:coredns"}]},
]


def containerd_config() -> str:
    c = BASE / "containerd"
    return f"""\
version = 2
root = "{CONTAINERD_ROOT}"
state = "{c / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{c / 'containerd.sock'}"
[ttrpc]
  address = "{c / 'containerd.sock.ttrpc'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{node_image('pause')}"
  # The VM gives root no CAP_SYS_RESOURCE, so runc cannot lower a process's oom_score_adj
  # below containerd's ("nsexec: failed to update /proc/self/oom_score_adj: Permission denied"
  # for the sandbox's -998): clamp the kubelet's scores to what is allowed instead.
  restrict_oom_score_adj = true
  # Pod network namespaces under our state folder, not /var/run/netns: sweep() finds them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # The kubelet's cgroup driver: cgroupfs (no systemd on this machine, cgroup v1).
        SystemdCgroup = false
        BinaryName = "runc"
        Root = "{BASE / 'runc'}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{BASE / 'cni' / 'net.d'}"
"""


def cni_config() -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": "kvscale-node",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "hairpinMode": True,
             # No masquerade and no default route: a pod reaches the node range and nothing else.
             "ipMasq": False,
             # One address of each family, IPv6 first; a route to each of our ranges.
             "ipam": {"type": "host-local",
                      "ranges": [[{"subnet": POD_CIDR6, "gateway": POD_GATEWAY6}],
                                 [{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                      "routes": [{"dst": NODE_RANGE6}, {"dst": NODE_RANGE}],
                      "dataDir": str(BASE / "cni" / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(port: int, healthz_port: int) -> dict:
    pki = BASE / "pki"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        # This machine has cgroup v1 (hybrid); 1.34 still runs there when told to.
        "failCgroupV1": False,
        "failSwapOn": False,
        "address": NODE_IP6,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        # Off: its KUBE-FIREWALL rule drops every packet to 127.0.0.0/8 from another source, in
        # the machine's own INPUT chain, which breaks the process runtime's loopback Services
        # (tests/cluster) while this node runs. Nothing here needs the chains.
        "makeIPTablesUtilChains": False,
        "clusterDomain": CLUSTER_DOMAIN,
        # CoreDNS runs on the node's address; pods get no resolver of the machine's.
        "clusterDNS": [NODE_IP6],
        "resolvConf": "",
        "containerRuntimeEndpoint": f"unix://{BASE / 'containerd' / 'containerd.sock'}",
        "podLogsDir": str(BASE / "pod-logs"),
        "maxPods": 40,
        "serializeImagePulls": False,
        # The engine image alone is ~7 GB: never collect the images we imported.
        "imageGCHighThresholdPercent": 100,
        # No disk-pressure eviction ("0%" switches a signal off): the disk is the machine's,
        # shared with image builds that briefly fill it, and under pressure the kubelet frees
        # space by deleting "unused" images: the 7 GB engine image we imported, and the
        # sandbox image itself.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%",
                         "nodefs.inodesFree": "0%", "imagefs.available": "0%",
                         "imagefs.inodesFree": "0%"},
        "nodeStatusReportFrequency": "10s",
    }


def kube_proxy_config(metrics_port: int, healthz_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(BASE / "pki" / "kube-proxy.kubeconfig")},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": f"{POD_CIDR6},{POD_CIDR}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        # NodePorts on the node's address only, never on the machine's real interfaces.
        "nodePortAddresses": list(NODE_PREFIXES),
        # No NodePorts on 127.0.0.1: kube-proxy would set route_localnet and add the same
        # loopback-blocking rule as the kubelet (see kubelet_config).
        "iptables": {"localhostNodePorts": False},
        # 0: leave the machine's conntrack sysctls as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig: Path, health_port: int) -> str:
    # Cluster names only: no `forward`, so a pod's lookup of anything else fails here.
    return f"""\
.:53 {{
    bind {" ".join(NODE_ADDRESSES)}
    errors
    health 127.0.0.1:{health_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 5
    }}
}}
"""


def node_image(which: str) -> str:
    return run("bash", str(NODE_IMAGES_SCRIPT), "name", which).stdout.strip()


def kvscale_image(which: str) -> str:
    return run("bash", str(IMAGES_SCRIPT), "name", which).stdout.strip()


# -------------------------------------------------------------------- start and stop


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start_node_env(logs: Path, *, images: tuple[str, ...] = ()) -> NodeEnv:
    """Start the control plane and the node; return once the node is Ready and every image is
    in containerd. `images`: the podman names to import (default: pause, redis and both of
    kvscale's). Stop with `stop_node_env`, which leaves nothing behind."""
    logs.mkdir(parents=True, exist_ok=True)
    lock = open(LOCK, "w")  # noqa: SIM115 (held for the node's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise NodeEnvError(f"another node environment holds {LOCK}") from None
    t0 = time.monotonic()
    env = NodeEnv(k8s_bins=find_or_build_bins(), node_bins=find_or_build_node_bins(), logs=logs,
                  lock=lock)
    env.timings["binaries"] = time.monotonic() - t0
    sweep(env.node_bins)
    env.sysctls = _read_sysctls()
    SYSCTLS_SAVED.write_text(json.dumps(env.sysctls))
    try:
        _start(env, images)
    except BaseException:
        stop_node_env(env)
        raise
    return env


def _start(env: NodeEnv, images: tuple[str, ...]) -> None:
    t0 = time.monotonic()
    BASE.mkdir(parents=True)
    for prefix in NODE_PREFIXES:
        # No duplicate address detection: the address would stay "tentative" (unusable) a moment.
        run("ip", "addr", "add", prefix, "dev", "lo", *(("nodad",) if ":" in prefix else ()))
    _make_cgroups()
    ports = {name: free_port() for name in ("etcd", "etcd-peer", "apiserver", "controller-manager",
                                            "scheduler", "kubelet", "kubelet-healthz",
                                            "proxy-metrics", "proxy-healthz", "coredns-health")}
    env.server = f"https://[{NODE_IP6}]:{ports['apiserver']}"
    _pki(env)
    pki = BASE / "pki"
    bins = env.k8s_bins

    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
    env.spawn("etcd", [str(bins / "etcd"), "--name=default", f"--data-dir={BASE / 'etcd'}",
                       f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                       f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                       f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync",
                       "--log-level=warn"])
    env.wait_for("etcd /health", lambda: _http_ok(f"{etcd_url}/health"), "etcd")
    env.spawn("kube-apiserver", [
        str(bins / "kube-apiserver"), f"--etcd-servers={etcd_url}",
        # The node's address: the kubelet, kube-proxy, CoreDNS and pods (through the
        # `kubernetes` Service, whose endpoint this is) all reach it there.
        f"--bind-address={NODE_IP6}", f"--advertise-address={NODE_IP6}",
        f"--secure-port={ports['apiserver']}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}", "--authorization-mode=RBAC",
        f"--service-cluster-ip-range={SERVICE_CIDR6},{SERVICE_CIDR}", "--allow-privileged=true",
        f"--service-account-issuer={env.server}", f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        # The node name resolves nowhere: exec, logs and port-forward go to its InternalIP.
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false",
    ])
    env.wait_for("kube-apiserver /readyz",
                 lambda: env.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
                 "kube-apiserver")
    admin = str(pki / "admin.kubeconfig")
    delegated = [f"--kubeconfig={admin}", f"--authentication-kubeconfig={admin}",
                 f"--authorization-kubeconfig={admin}", "--bind-address=127.0.0.1",
                 "--leader-elect=false"]
    env.spawn("kube-controller-manager", [
        str(bins / "kube-controller-manager"), *delegated,
        f"--secure-port={ports['controller-manager']}", "--controllers=*",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR6},{SERVICE_CIDR}",
    ])
    env.spawn("kube-scheduler", [str(bins / "kube-scheduler"), *delegated,
                                 f"--secure-port={ports['scheduler']}"])
    env.apply(CLUSTER_RBAC)
    env.timings["control plane"] = time.monotonic() - t0

    t1 = time.monotonic()
    _write(BASE / "containerd" / "config.toml", containerd_config(), 0o644)
    _write(BASE / "cni" / "net.d" / "10-kvscale-node.conflist", json.dumps(cni_config()), 0o644)
    names = images or (node_image("pause"), node_image("redis"), kvscale_image("engine"),
                       kvscale_image("control-plane"))
    with open(env.logs / "images.log", "a") as log:
        _start_containerd(env, log)
        configs = []
        for name in names:
            try:
                configs.append(_import_image(env, name, log))
            except NodeEnvError as error:
                # A cached layout that does not import (a blob cut short, say): once more
                # from a fresh save.
                _log(log, f"{name}: {error}: saving it whole again")
                shutil.rmtree(_layout(name), ignore_errors=True)
                configs.append(_import_image(env, name, log))
        if not images:
            _prune_image_cache(env, names, configs, log)
    env.timings["images"] = time.monotonic() - t1

    t2 = time.monotonic()
    _write(BASE / "kubelet" / "config.yaml",
           json.dumps(kubelet_config(ports["kubelet"], ports["kubelet-healthz"])), 0o644)
    env.spawn("kubelet", [
        str(env.node_bins / "kubelet"), f"--config={BASE / 'kubelet' / 'config.yaml'}",
        f"--kubeconfig={pki / 'kubelet.kubeconfig'}", f"--root-dir={BASE / 'kubelet' / 'root'}",
        f"--cert-dir={BASE / 'kubelet' / 'pki'}", f"--hostname-override={NODE_NAME}",
        f"--node-ip={','.join(NODE_ADDRESSES)}", "--v=1",
    ])
    _write(BASE / "kube-proxy.yaml",
           json.dumps(kube_proxy_config(ports["proxy-metrics"], ports["proxy-healthz"])), 0o644)
    env.spawn("kube-proxy", [str(env.node_bins / "kube-proxy"), f"--config={BASE / 'kube-proxy.yaml'}"])
    _write(BASE / "Corefile", corefile(pki / "coredns.kubeconfig", ports["coredns-health"]), 0o644)
    env.spawn("coredns", [str(env.node_bins / "coredns"), "-conf", str(BASE / "Corefile")])
    env.wait_for(f"node {NODE_NAME} Ready", lambda: _node_ready(env), "kubelet")
    env.wait_for("kube-proxy /healthz",
                 lambda: _http_ok(f"http://127.0.0.1:{ports['proxy-healthz']}/healthz"), "kube-proxy")
    env.wait_for("coredns /health",
                 lambda: _http_ok(f"http://127.0.0.1:{ports['coredns-health']}/health"), "coredns")
    env.wait_for("the default ServiceAccount",
                 lambda: env.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                 "kube-controller-manager")
    env.timings["node"] = time.monotonic() - t2


# ------------------------------------------------------------------------ image cache


def _log(log: IO[str], message: str) -> None:
    log.write(f"{time.strftime('%H:%M:%S')} {message}\n")
    log.flush()


def _start_containerd(env: NodeEnv, log: IO[str]) -> None:
    """Start containerd on the image cache's root: as a clean stop left it (images only), or
    wiped when that is not known (no IMAGE_CACHE_CLEAN: first run, killed run, failed clean-up)
    or not what containerd itself reports."""
    clean = IMAGE_CACHE_CLEAN.exists()
    # Taken before containerd may change anything: only the next clean stop writes it again.
    IMAGE_CACHE_CLEAN.unlink(missing_ok=True)
    if not clean and CONTAINERD_ROOT.exists():
        _log(log, f"image cache: {CONTAINERD_ROOT} not left clean by a stop: wiped, full import")
        _wipe_containerd_root()
    for sub in CONTAINERD_ROOT_PER_CONTAINER:
        shutil.rmtree(CONTAINERD_ROOT / sub, ignore_errors=True)
    _spawn_containerd(env)
    found = _containerd_leftovers(env)
    if found:
        _log(log, f"image cache: containerd holds {found[:5]}: wiped, full import")
        proc = env.processes.pop("containerd")
        proc.terminate()
        proc.wait(30)
        _wipe_containerd_root()
        _spawn_containerd(env)


def _spawn_containerd(env: NodeEnv) -> None:
    env.spawn("containerd", ["containerd", "--config", str(BASE / "containerd" / "config.toml")])
    env.wait_for("containerd", lambda: env.ctr("version", check=False).returncode == 0, "containerd")


def _wipe_containerd_root() -> None:
    for target in sorted(_mounts_under(CONTAINERD_ROOT), key=len, reverse=True):
        run("umount", "-l", target, check=False)
    shutil.rmtree(CONTAINERD_ROOT, ignore_errors=True)
    if CONTAINERD_ROOT.exists():
        raise NodeEnvError(f"cannot remove {CONTAINERD_ROOT}")


def _containerd_leftovers(env: NodeEnv) -> list[str]:
    """Whatever in containerd is not an image: containers (a CRI sandbox is one too), tasks,
    leases, snapshots that are not committed layers (a container's writable layer, an unpack
    cut short)."""
    found = [f"container {c}" for c in env.ctr("containers", "ls", "-q").stdout.split()]
    found += [f"task {t}" for t in env.ctr("tasks", "ls", "-q").stdout.split()]
    found += [f"lease {lease}" for lease in env.ctr("leases", "ls", "-q").stdout.split()]
    found += [f"snapshot {key} ({kind})" for key, kind in _snapshots(env).items()
              if kind != "Committed"]
    return found


def _snapshots(env: NodeEnv) -> dict[str, str]:
    rows = env.ctr("snapshots", "ls").stdout.splitlines()[1:]
    return {row.split()[0]: row.split()[-1] for row in rows if row.split()}


def _release_containers(env: NodeEnv) -> bool:
    """Remove, through containerd, everything but images (what the kubelet had no time to
    collect), so that its root can serve the next run; True when nothing else is left."""
    try:
        for task in env.ctr("tasks", "ls", "-q").stdout.split():
            env.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
            env.ctr("tasks", "rm", "-f", task, check=False)
        containers = env.ctr("containers", "ls", "-q").stdout.split()
        if containers:
            # With their writable snapshots (ctr's default).
            env.ctr("containers", "rm", *containers, check=False)
        leases = env.ctr("leases", "ls", "-q").stdout.split()
        if leases:
            env.ctr("leases", "rm", *leases, check=False)
        for key, kind in _snapshots(env).items():
            if kind != "Committed":
                env.ctr("snapshots", "rm", key, check=False)
        return not _containerd_leftovers(env)
    except (NodeEnvError, subprocess.SubprocessError, OSError):
        return False


def _repository(name: str) -> str:
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def _layout(name: str) -> Path:
    """The cached OCI layout of `name`: one per repository, so a new tag reuses the blobs of
    the one before."""
    return IMAGE_CACHE_OCI / _repository(name).replace("/", "_")


def _prune_image_cache(env: NodeEnv, names: tuple[str, ...], configs: list[str],
                       log: IO[str]) -> None:
    """With the lane's own set of images: drop every other image from containerd (an older
    tag, an older build's `sha256:<image ID>` name that the CRI adds to each image it sees;
    its layers no other image shares go with containerd's garbage collection) and every other
    repository's layout, so the cache holds each image once."""
    listed = env.ctr("images", "ls", "-q").stdout.split()
    stale = [name for name in listed if name not in names and name not in configs]
    if stale:
        env.ctr("images", "rm", *stale)
        _log(log, f"image cache: removed {' '.join(stale)} from containerd")
    keep = {_layout(name).name for name in names}
    for layout in IMAGE_CACHE_OCI.glob("*"):
        if layout.name not in keep:
            shutil.rmtree(layout, ignore_errors=True)
            _log(log, f"image cache: removed {layout}")


def _chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain ID of each layer: the key of its committed snapshot in containerd."""
    chain: list[str] = []
    for diff_id in diff_ids:
        chain.append(diff_id if not chain else
                     "sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def _blob(layout: Path, digest: str) -> Path:
    algorithm, hexdigest = digest.split(":", 1)
    return layout / "blobs" / algorithm / hexdigest


def _saved_manifest(layout: Path, name: str) -> dict:
    """Keep the layout to `name`'s manifest (a new tag of the same repository is saved beside
    the old one) and delete every blob it does not reference; the manifest's descriptor."""
    index = json.loads((layout / "index.json").read_text())
    ours = [m for m in index["manifests"]
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == name]
    if len(ours) != 1:
        raise NodeEnvError(f"{layout}/index.json has {len(ours)} manifests named {name}")
    descriptor = ours[0]
    if len(index["manifests"]) > 1:
        index["manifests"] = ours
        (layout / "index.json").write_text(json.dumps(index))
    manifest = json.loads(_blob(layout, descriptor["digest"]).read_text())
    keep = {descriptor["digest"], manifest["config"]["digest"],
            *(layer["digest"] for layer in manifest["layers"])}
    for path in (layout / "blobs").glob("*/*"):
        if f"{path.parent.name}:{path.name}" not in keep:
            path.unlink()
    for path in layout.glob("oci-put-blob*"):
        path.unlink()  # a save cut short (podman writes a blob there, then renames it)
    return descriptor


def _import_image(env: NodeEnv, name: str, log: IO[str]) -> str:
    """Bring `name` from kvscale's podman store into containerd, sending only what containerd
    has no snapshot of: save into the image's cached OCI layout (podman writes the changed
    blobs only), then `ctr images import` of a tar of that layout holding the manifest, the
    config and the layers from the first one without a snapshot upwards. containerd unpacks
    only layers whose chain ID has no snapshot, so the others need no tarball. Returns the
    image's config digest (its ID)."""
    t0 = time.monotonic()
    layout = _layout(name)
    saved = run("bash", str(NODE_IMAGES_SCRIPT), "save-oci", str(layout), name, timeout=1800)
    _log(log, saved.stderr.strip())
    descriptor = _saved_manifest(layout, name)
    manifest = json.loads(_blob(layout, descriptor["digest"]).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    layers = manifest["layers"]
    chain = _chain_ids(config["rootfs"]["diff_ids"])
    if len(chain) != len(layers):
        raise NodeEnvError(f"{name}: {len(layers)} layers but {len(chain)} diff IDs")
    snapshots = _snapshots(env)
    have = 0
    while have < len(chain) and snapshots.get(chain[have]) == "Committed":
        have += 1
    missing = layers[have:]
    listed = env.ctr("images", "ls", f"name=={name}").stdout.splitlines()[1:]
    current = listed[0].split()[2] if listed else None
    if current == descriptor["digest"] and not missing:
        _log(log, f"{name}: in containerd already ({len(layers)} layers)")
        return str(manifest["config"]["digest"])
    # containerd's content store is plain files named by digest, on the same disk as the
    # cache: hard links let the import find a layer there (it then records it without writing
    # a copy) and the unpack read it, while the disk holds the tarball once. Discarding it
    # afterwards removes containerd's link only.
    store = CONTAINERD_ROOT / "io.containerd.content.v1.content"  # blobs/<algorithm>/<hex>
    for layer in missing:
        target = _blob(store, layer["digest"])
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(_blob(layout, layer["digest"]), target)
    # Named through containerd's own annotation, which `ctr import` takes as the image's name.
    staging = BASE / "images" / layout.name
    _write(staging / "index.json", json.dumps({
        "schemaVersion": 2,
        "manifests": [{**descriptor, "annotations": {"io.containerd.image.name": name}}]}), 0o644)
    members = [str(_blob(Path("."), d).as_posix()) for d in
               (descriptor["digest"], manifest["config"]["digest"],
                *(layer["digest"] for layer in missing))]
    # containerd's garbage collection may delete a link made above before the import records
    # it (it deletes store files no namespace knows): the import then writes that layer, and
    # tar, seeing the link count (ctime) change, warns "file changed as we read it" and exits
    # 1, though what it sent is whole. containerd checks every digest it writes and each
    # layer's diff ID as it unpacks; only tar's fatal status 2 is an error here.
    tar = subprocess.Popen(["tar", "--warning=no-file-changed", "-C", str(staging), "-c",
                            "index.json", "-C", str(layout), "oci-layout", *members],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        imported = subprocess.run(["ctr", "-a", str(env.containerd_socket), "-n", "k8s.io",
                                   "images", "import", "-"], stdin=tar.stdout,
                                  capture_output=True, text=True, timeout=1800, check=False)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar_err = tar.communicate(timeout=60)[1].decode(errors="replace")
    if imported.returncode != 0 or tar.returncode not in (0, 1):
        raise NodeEnvError(f"importing {name} failed: {imported.stderr.strip()} {tar_err.strip()}")
    listed = env.ctr("images", "ls", f"name=={name}").stdout.splitlines()[1:]
    if not listed or listed[0].split()[2] != descriptor["digest"]:
        raise NodeEnvError(f"{name} is not {descriptor['digest']} in containerd after the import")
    if _snapshots(env).get(chain[-1]) != "Committed":
        raise NodeEnvError(f"{name}: no snapshot {chain[-1]} after the import")
    _discard_layer_blobs(env, [layer["digest"] for layer in layers])
    size = sum(layer["size"] for layer in missing)
    _log(log, f"{name}: imported {len(missing)} of {len(layers)} layers "
              f"({size / 1e6:.1f} MB) in {time.monotonic() - t0:.1f}s")
    return str(manifest["config"]["digest"])


def _discard_layer_blobs(env: NodeEnv, layers: list[str]) -> None:
    """Delete an imported image's layer tarballs once they are unpacked, as containerd's
    discard_unpacked_layers does after a pull: containers run from the snapshots, and the
    manifest and config stay, so the CRI still lists the image. Here that removes containerd's
    hard links only (the cached OCI layout keeps the tarballs for the next `podman save`)."""
    present = set(env.ctr("content", "ls", "-q").stdout.split())
    discard = [digest for digest in layers if digest in present]
    if discard:
        env.ctr("content", "rm", *discard)


def _node_ready(env: NodeEnv) -> bool:
    node = env.kubectl_json("get", "node", NODE_NAME)
    ready = any(c["type"] == "Ready" and c["status"] == "True"
                for c in node["status"].get("conditions", []))
    tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints", []))
    return ready and not tainted


def stop_node_env(env: NodeEnv, *, grace: float = 60.0) -> None:
    """Delete every pod through the API (the kubelet stops them and tears their sandboxes down
    as on any node), stop the processes, then sweep what is left and restore the machine."""
    t0 = time.monotonic()
    try:
        if env.processes.get("kubelet") is not None and env.processes["kubelet"].poll() is None:
            env.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=5",
                        "--wait=false", check=False)
            try:
                # Running tasks, not containers: exited ones wait for the kubelet's garbage
                # collection (once a minute); the sweep removes those with containerd's state.
                wait_until(lambda: not env.kubectl_json("get", "pods", "-A")["items"]
                           and not env.ctr("tasks", "ls", "-q", check=False).stdout.split(),
                           grace, interval=1.0, what="every pod and running container gone")
            except (TimeoutError, NodeEnvError, ValueError):
                pass  # the sweep below removes them the hard way
        env.timings["stop: pods"] = time.monotonic() - t0
        t0 = time.monotonic()
        for name in reversed(list(env.processes)):
            proc = env.processes[name]
            if name == "containerd" and proc.poll() is None:
                # The kubelet is gone: what it left goes through containerd, whose root is
                # the image cache's (see the module docstring).
                env.cache_clean = _release_containers(env)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if name == "containerd" and proc.returncode != 0:
                env.cache_clean = False  # killed: its root is not known to be whole
        env.processes.clear()
        env.timings["stop: processes"] = time.monotonic() - t0
        t0 = time.monotonic()
        sweep(env.node_bins)
        if env.cache_clean and not _mounts_under(CONTAINERD_ROOT):
            IMAGE_CACHE_CLEAN.touch()
        env.timings["stop: sweep"] = time.monotonic() - t0
    finally:
        if env.sysctls:
            _restore_sysctls(env.sysctls)
        if env.lock is not None:
            env.lock.close()
            env.lock = None


def _main() -> int:
    """`python tests/node/nodeenv.py up|down`: a node to look at by hand (up blocks until ^C)."""
    import sys

    logs = Path(os.environ.get("KVSCALE_NODE_LOGS", "/tmp/kvscale-node-logs"))
    if sys.argv[1:] == ["down"]:
        sweep(find_or_build_node_bins())
        print("\n".join(leftovers()) or "nothing left")
        return 0
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # A background job ignores SIGINT: TERM stops it cleanly too.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    env = start_node_env(logs)
    print(f"node Ready; export KUBECONFIG={env.kubeconfig}; timings {env.timings}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop_node_env(env)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())


