"""The process runtime's pod network: one network namespace per pod, on a bridge of the host.

A real node gives each pod a network namespace of its own: its pod IP on eth0, a loopback nobody
else shares (so `kubectl port-forward`, which dials localhost inside the pod, reaches what the
pod listens on), and a route out through the node. The process runtime (tests/cluster/kubelet.py)
does the same with `ip` (root needed):

- a bridge `kvpodbrN` holding the first address of the environment's pod /24 (198.18.N.1), the
  pods' gateway and the host's address on the pod network;
- per pod, a namespace `kvscale-pod-N-M` with lo up and one end of a veth pair as eth0 carrying the
  pod IP (198.18.N.M/24, default route via the bridge); the other end, `kvpodNvM`, is a port of the
  bridge. Every container of the pod runs in it (`nsenter --net`);
- the service /24 made `local` on the host's lo, where kube-proxy's emulation listens on each
  ClusterIP: a pod reaches a Service through its gateway, the host takes the packet as its own.

Both /24s lie in 198.18.0.0/16 (RFC 2544's benchmarking range, never routed), so nothing a pod
sends leaves the machine. Everything is removed by `stop` (and a pod's namespace when it goes).
"""

from __future__ import annotations

import ipaddress
import subprocess
import threading
from pathlib import Path

NETNS_DIR = Path("/run/netns")
NETNS_PREFIX = "kvscale-pod-"
LINK_PREFIX = "kvpod"  # kvpodbrN, the bridge; kvpodNvM, the host end of a pod's veth


class PodNetworkError(RuntimeError):
    """An `ip` command failed (not root, no veth/bridge support, a name already taken)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise PodNetworkError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def link_names() -> set[str]:
    """Every network interface of the host's namespace."""
    return {line.split(":", 2)[1].strip().split("@", 1)[0]
            for line in ip("-o", "link", "show").stdout.splitlines()}


def bridge_name(tag: str | int) -> str:
    return f"{LINK_PREFIX}br{tag}"


def netns_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


class PodNetwork:
    """The bridge, the per-pod namespaces and the Services' local route of one environment."""

    def __init__(self, pod_cidr: str, service_cidr: str) -> None:
        self.pods = ipaddress.ip_network(pod_cidr)
        self.services = ipaddress.ip_network(service_cidr)
        if self.pods.prefixlen != 24:
            raise ValueError(f"the pod network is a /24, not {pod_cidr}")
        self.tag = str(self.pods.network_address).split(".")[2]  # N of 198.18.N.0/24
        self.bridge = bridge_name(self.tag)
        self.gateway = str(self.pods[1])
        self._namespaces: dict[str, str] = {}  # pod IP -> namespace name
        self._lock = threading.Lock()
        self._started = False

    # -- names -------------------------------------------------------------------------------------
    def namespace_name(self, pod_ip: str) -> str:
        return f"{NETNS_PREFIX}{self.tag}-{pod_ip.rsplit('.', 1)[1]}"

    def veth_name(self, pod_ip: str) -> str:
        return f"{LINK_PREFIX}{self.tag}v{pod_ip.rsplit('.', 1)[1]}"  # at most 12 of IFNAMSIZ's 15

    def namespace_path(self, pod_ip: str) -> Path:
        return NETNS_DIR / self.namespace_name(pod_ip)

    def enter(self, pod_ip: str) -> list[str]:
        """The argv prefix that runs a command in the pod's network namespace."""
        return ["nsenter", f"--net={self.namespace_path(pod_ip)}", "--"]

    def leftovers(self) -> dict[str, list[str]]:
        """What of this network still exists on the host (empty once stopped)."""
        links = link_names()
        prefix = f"{NETNS_PREFIX}{self.tag}-"
        routes = ip("route", "show", "table", "local", "type", "local", str(self.services)).stdout
        return {
            "netns": sorted(n for n in netns_names() if n.startswith(prefix)),
            "links": sorted(n for n in links if n == self.bridge or n.startswith(f"{LINK_PREFIX}{self.tag}v")),
            "routes": [line for line in routes.splitlines() if line.strip()],
        }

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.bridge in link_names():
            raise PodNetworkError(f"{self.bridge} already exists: another environment uses "
                                  f"{self.pods}, or one was left behind (`ip link del {self.bridge}`)")
        self._started = True
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.pods.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        # Any ClusterIP answers on the host, as the kube-proxy emulation listens there.
        ip("route", "replace", "local", str(self.services), "dev", "lo", "table", "local")

    def add_pod(self, pod_ip: str) -> str:
        """The pod's namespace, its loopback up and eth0 on the bridge; returns its name."""
        name, veth = self.namespace_name(pod_ip), self.veth_name(pod_ip)
        with self._lock:
            self._namespaces[pod_ip] = name
        ip("netns", "add", name)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "addr", "add", f"{pod_ip}/{self.pods.prefixlen}", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "route", "add", "default", "via", self.gateway)
        return name

    def remove_pod(self, pod_ip: str) -> None:
        """The namespace goes, and with it eth0 and so its veth peer (idempotent)."""
        with self._lock:
            name = self._namespaces.pop(pod_ip, None)
        if name is None:
            return
        ip("netns", "del", name, check=False)
        # A process still inside keeps the namespace alive, and the veth with it: cut the cable.
        ip("link", "del", self.veth_name(pod_ip), check=False)

    def stop(self) -> None:
        with self._lock:
            pod_ips = list(self._namespaces)
        for pod_ip in pod_ips:
            self.remove_pod(pod_ip)
        if self._started:
            ip("link", "del", self.bridge, check=False)
            ip("route", "del", "local", str(self.services), "dev", "lo", "table", "local", check=False)
            self._started = False


__all__ = ["NETNS_PREFIX", "PodNetwork", "PodNetworkError", "bridge_name", "link_names", "netns_names"]
