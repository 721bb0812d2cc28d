"""A kubelet and kube-proxy for kwok nodes whose pods run as real local processes.

kwok simulates nodes; it runs no containers. For the whole-platform tests every pod bound to a
kwok node of a `process_pods` environment (tests/cluster/testenv.py) runs here instead, as a
kubelet would run it:

- The container's command and args, with `$(VAR)` expanded the Kubernetes way from its env
  (plain values, the downward API, Secret and ConfigMap keys), become a local process. The image
  names the executable: an image whose name starts with `kvscale` provides this checkout's
  `kvscale` entry point, `redis` provides Debian's `redis-server` (IMAGES).
- Each pod gets a network namespace of its own (tests/cluster/pod_network.py): its address in
  the environment's pod /24 of 198.18.0.0/16 (the apiserver refuses 127/8 in EndpointSlices) on
  eth0, a loopback of its own, and a veth to a bridge of the host, which reaches every pod IP.
  So pods listen on all their addresses as on a real node, and two pods may use the same port;
  `kubectl port-forward` is dialling 127.0.0.1 inside the pod's namespace (`PodWorker.enter`).
  Nothing leaves the machine. Each process runs in its own mount namespace where
  /etc/hosts resolves the cluster's Service names (as cluster DNS would), /tmp and /dev/shm are
  the pod's own emptyDirs, configMap and secret volumes are read-only folders of their keys
  (written at container start), and a pod with a service-account token finds it where client
  libraries look (/var/run/secrets/kubernetes.io/serviceaccount) with KUBERNETES_SERVICE_HOST set.
- Startup, readiness and liveness probes (httpGet, tcpSocket) run against the process and are
  reported in the pod's status (Ready, ContainersReady, containerStatuses); the EndpointSlice
  controller takes it from there. A container that exits is restarted (restartPolicy Always)
  with a growing back-off; liveness failures restart it too.
- A pod being deleted gets its preStop hook, SIGTERM, and SIGKILL after its grace period, then
  is removed from the API (the kubelet's final delete).
- Every Service with a ClusterIP gets a TCP proxy on that address (kube-proxy's userspace mode):
  the service /24 is local on the host, whom pods reach through their gateway (the bridge). The
  `kubernetes` Service leads to the apiserver, which listens on the host's 127.0.0.1.

Tests drive failures with `kill` (a crash: the process dies, the runtime restarts it) and read
`log_path` after a failure. Everything the runtime starts dies with it (PR_SET_PDEATHSIG), and
`stop` removes every namespace, veth and the bridge it made.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pod_network import PodNetwork, PodNetworkError
from testenv import K8sEnv

from kvscale.operator.kube import ApiError, Kube, load_connection, path_for
from kvscale.processes import die_with_parent

log = logging.getLogger("kvscale.tests.kubelet")

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The loop syncs when a watch reports a change to pods, Services or EndpointSlices, or a pod
# worker finishes; RESYNC_S is only the safety net for a missed event. Polling every 0.2 s instead
# cost 15 LISTs a second, a fifth of the apiserver's CPU over a whole test run.
RESYNC_S = 3.0
WATCH_TIMEOUT_S = 30
WATCHED = ("/api/v1/pods", "/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices")
MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class Image:
    """What an image provides here: its executables and the environment its build sets."""

    executables: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)


def default_images() -> dict[str, Image]:
    kvscale = str(Path(sys.executable).with_name("kvscale"))
    # The image converts the bundled model at build time: here, the checkout's cache holds it.
    cache = os.environ.get("KVSCALE_CACHE") or str(Path.home() / ".cache" / "kvscale")
    # Its entry point and its Python, with kvscale installed (helm test pods run `python -c`).
    hf = str(Path(sys.executable).with_name("hf"))  # the Hub's CLI: hf:// models' init containers
    # The checkout whose `kvscale` this test imports, first on the path: a git worktree sharing
    # another checkout's virtualenv (installed editable from there) runs its own code in the pods.
    import kvscale as tested

    checkout = str(Path(tested.__file__).resolve().parents[1])
    kvscale_image = Image({"kvscale": kvscale, "python": sys.executable, "python3": sys.executable,
                           "hf": hf},
                          {"KVSCALE_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                           "PYTHONPATH": checkout})
    redis = shutil.which("redis-server")
    images = {"kvscale": kvscale_image}
    if redis is not None:
        images["redis"] = Image({"redis-server": redis})
    return images


def image_key(image: str) -> str:
    """The repository's last path segment without tag or digest: ghcr.io/x/kvscale:1 -> kvscale."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def find_image(images: dict[str, Image], image: str) -> Image | None:
    key = image_key(image)
    return next((images[prefix] for prefix in sorted(images, key=len, reverse=True)
                 if key == prefix or key.startswith(prefix + "-")), None)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, values: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ escapes, an unknown $(VAR) stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return values.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


def field_ref(pod: dict[str, Any], path: str) -> str:
    meta, status = pod["metadata"], pod.get("status") or {}
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if path in simple:
        return simple[path]
    found = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if found:
        return (meta.get(found.group(1)) or {}).get(found.group(2), "")
    raise ValueError(f"unsupported fieldRef {path!r}")


class ConfigError(Exception):
    """What a kubelet reports as CreateContainerConfigError."""


def container_env(kube: Kube, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    values: dict[str, str] = {}
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            values[name] = expand(var["value"], values)
            continue
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            values[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind, ref = (("secrets", source["secretKeyRef"]) if "secretKeyRef" in source
                         else ("configmaps", source["configMapKeyRef"]))
            obj = kube.get(path_for("v1", kind, namespace, ref["name"]))
            data = (obj or {}).get("data") or {}
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"{kind[:-1]} {ref['name']!r} or its key {ref['key']!r} not found")
            raw = data[ref["key"]]
            values[name] = base64.b64decode(raw).decode() if kind == "secrets" else raw
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
    return values


# ------------------------------------------------------------------------------------------ pods


@dataclass
class ContainerState:
    """One container of one pod, as the kubelet tracks it."""

    name: str
    process: subprocess.Popen | None = None
    ready: bool = False
    started: bool = False  # the startup probe passed (or there is none)
    restart_count: int = 0
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str = ""
    last_exit: dict[str, Any] | None = None
    running_since: str | None = None
    log_path: Path | None = None
    init_process: subprocess.Popen | None = None  # the init container running now
    initialized: bool = False  # every init container has completed


def rfc3339(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at if at is not None else time.time()))


class PodWorker:
    """Runs one pod: its (single) container's process, probes, restarts and termination."""

    def __init__(self, runtime: KubeletRuntime, pod: dict[str, Any], ip: str) -> None:
        self.runtime = runtime
        self.pod = pod
        self.ip = ip
        self.key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.uid = pod["metadata"]["uid"]
        spec = pod["spec"]
        if len(spec["containers"]) != 1:
            raise ValueError("the process runtime runs pods of one container")
        self.container = spec["containers"][0]
        self.state = ContainerState(self.container["name"])
        self.dir = runtime.workdir / "pods" / f"{self.key[0]}_{self.key[1]}"
        self.start_time = rfc3339()
        self.finished_phase: str | None = None  # Succeeded / Failed, for run-to-completion pods
        self.terminating = threading.Event()
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.key[1]}", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def terminate(self, grace_s: float) -> None:
        """The pod is being deleted: preStop, SIGTERM, SIGKILL after `grace_s`."""
        if self.terminating.is_set():
            return
        self.terminating.set()
        threading.Thread(target=self._terminate, args=(grace_s,), daemon=True,
                         name=f"stop-{self.key[1]}").start()

    def _terminate(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        init = self.state.init_process
        if init is not None and init.poll() is None:  # an init container has no preStop
            init.kill()
            init.wait()
        self._pre_stop(deadline)
        process = self.state.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        self.runtime.wake()  # the loop deletes a terminated pod at once, not at its next resync

    def _pre_stop(self, deadline: float) -> None:
        hook = ((self.container.get("lifecycle") or {}).get("preStop")) or {}
        if "exec" in hook:
            command = hook["exec"]["command"]
            if command and command[0] == "sleep" and len(command) == 2:
                time.sleep(min(float(command[1]), max(0.0, deadline - time.monotonic())))
            else:
                log.warning("pod %s: preStop exec %s is not supported here", self.key, command)
        elif "httpGet" in hook:
            self._http_get(hook["httpGet"], timeout=max(0.1, deadline - time.monotonic()))
        elif "sleep" in hook:
            time.sleep(min(float(hook["sleep"]["seconds"]), max(0.0, deadline - time.monotonic())))

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Signal the container's process (a crash when SIGKILL); returns its pid."""
        process = self.state.process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"pod {self.key} has no running process")
        process.send_signal(sig)
        return process.pid

    # -- the container's process ------------------------------------------------------------------
    def _command(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        image = find_image(self.runtime.images, container["image"])
        if image is None:
            raise LookupError(f"image {container['image']!r} has no local executable "
                              f"(known: {', '.join(sorted(self.runtime.images))})")
        pod = {**self.pod, "status": {**(self.pod.get("status") or {}), "podIP": self.ip,
                                      "hostIP": self.runtime.node_ip}}
        values = container_env(self.runtime.kube, pod, container)
        argv = [expand(a, values) for a in (container.get("command") or [])]
        argv += [expand(a, values) for a in (container.get("args") or [])]
        if not argv or argv[0] not in image.executables:
            raise LookupError(f"image {container['image']!r} has no {argv[:1]} here "
                              f"(it provides {', '.join(sorted(image.executables))})")
        argv[0] = image.executables[argv[0]]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": self.key[1],
               **image.env, **values}
        if self.pod["spec"].get("automountServiceAccountToken", True) is not False:
            env["KUBERNETES_SERVICE_HOST"] = self.runtime.env.kubernetes_service_ip
            env["KUBERNETES_SERVICE_PORT"] = "443"
        return argv, env

    def _mounts(self, container: dict[str, Any]) -> list[tuple[Path, Path, bool]]:
        """(source, target, read-only) bind mounts for the process's own mount namespace, in
        order: a volume mounted inside another (a claim under the model cache) comes after it."""
        mounts = [(self.runtime.hosts_file, Path("/etc/hosts"), False)]
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        # What the process itself needs from this machine (a checkout or its .venv under /tmp,
        # say) must stay visible: no volume is mounted over it.
        needed = [Path(sys.prefix).resolve(), REPO_ROOT, self.runtime.workdir.resolve()]
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"]) or {}
            target = Path(mount["mountPath"])
            if any(path.is_relative_to(target) for path in needed):
                log.info("pod %s: %s not mounted (it holds what the process runs)", self.key, target)
                continue
            read_only = bool(mount.get("readOnly"))
            if "emptyDir" in volume:
                source = self.dir / "volumes" / mount["name"]
                source.mkdir(parents=True, exist_ok=True)
                source.chmod(0o1777)
                mounts.append((source, target, read_only))
            elif "configMap" in volume or "secret" in volume:
                # Always read-only, as the kubelet mounts them.
                mounts.append((self._key_files(mount["name"], volume), target, True))
            elif "persistentVolumeClaim" in volume:
                mounts.append((self._claim_path(volume["persistentVolumeClaim"]["claimName"]), target,
                               read_only or bool(volume["persistentVolumeClaim"].get("readOnly"))))
        token_dir = self.dir / "serviceaccount"
        if (token_dir / "token").is_file():
            mounts.append((token_dir, SERVICE_ACCOUNT_DIR, False))
        return mounts

    def _key_files(self, name: str, volume: dict[str, Any]) -> Path:
        """A configMap or secret volume: a folder with one file per key, written when the
        container starts (the kubelet also refreshes it later; nothing here needs that)."""
        if "configMap" in volume:
            ref, kind, object_name = volume["configMap"], "configmaps", volume["configMap"].get("name")
        else:
            ref, kind, object_name = volume["secret"], "secrets", volume["secret"].get("secretName")
        obj = self.runtime.kube.get(path_for("v1", kind, self.key[0], object_name or ""))
        if obj is None and not ref.get("optional"):
            raise ConfigError(f"{kind[:-1]} {object_name!r} not found")
        files: dict[str, bytes] = {}
        for key, value in ((obj or {}).get("data") or {}).items():
            files[key] = base64.b64decode(value) if kind == "secrets" else value.encode()
        for key, value in ((obj or {}).get("binaryData") or {}).items():
            files[key] = base64.b64decode(value)
        if ref.get("items"):  # only the keys listed, at their paths
            files = {item["path"]: files[item["key"]] for item in ref["items"] if item["key"] in files}
        folder = self.dir / "volumes" / name
        shutil.rmtree(folder, ignore_errors=True)
        for path, content in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(content)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _claim_path(self, claim: str) -> Path:
        """The folder of the hostPath or local PersistentVolume bound to ``claim``."""
        namespace = self.key[0]
        pvc = self.runtime.kube.get(path_for("v1", "persistentvolumeclaims", namespace, claim))
        volume_name = ((pvc or {}).get("spec") or {}).get("volumeName")
        if not volume_name or ((pvc or {}).get("status") or {}).get("phase") != "Bound":
            raise ConfigError(f"persistentvolumeclaim {claim!r} is not bound")
        pv = self.runtime.kube.get(path_for("v1", "persistentvolumes", None, volume_name)) or {}
        source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
        if not source:
            raise ConfigError(f"persistentvolume {volume_name!r} is neither hostPath nor local")
        return Path(source["path"])

    def _project_token(self) -> None:
        if self.pod["spec"].get("automountServiceAccountToken", True) is False:
            return
        namespace, name = self.key
        account = self.pod["spec"].get("serviceAccountName") or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": 7200, "boundObjectRef": {
                       "apiVersion": "v1", "kind": "Pod", "name": name, "uid": self.uid}}}
        token = self.runtime.kube.create(
            path_for("v1", "serviceaccounts", namespace, account, "token"), request)
        token_dir = self.dir / "serviceaccount"
        token_dir.mkdir(parents=True, exist_ok=True)
        (token_dir / "token").write_text(token["status"]["token"])
        (token_dir / "namespace").write_text(namespace)
        shutil.copy(self.runtime.env.ca_cert, token_dir / "ca.crt")
        SERVICE_ACCOUNT_DIR.mkdir(parents=True, exist_ok=True)  # an empty mount point on the host

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in this pod's network namespace (as its
        containers run): `kubectl port-forward` is a dial to 127.0.0.1 from there."""
        return self.runtime.network.enter(self.ip)

    def _start_process(self, container: dict[str, Any]) -> subprocess.Popen:
        """``container``'s command in the pod's network namespace and a mount namespace of its
        own, its output appended to the pod's log."""
        argv, env = self._command(container)
        steps = []
        for source, target, read_only in self._mounts(container):
            # A mount point the host lacks (/models) is made in the pod's namespace; at the top
            # level that leaves an empty folder on this machine, as SERVICE_ACCOUNT_DIR does.
            make = f"mkdir -p {shlex.quote(str(target))} && " if source.is_dir() else ""
            step = f"{make}mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}"
            if read_only:
                step += f" && mount -o remount,bind,ro {shlex.quote(str(target))}"
            steps.append(step)
        script = " && ".join(steps)
        wrapped = [*self.enter(), "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                   f'{script} && exec "$@"', "sh", *argv]
        self.state.log_path = self.dir / f"{self.state.name}.log"
        out = open(self.state.log_path, "ab")  # noqa: SIM115 - the child holds it
        out.write(f"--- start {container['name']} {rfc3339()}: {shlex.join(argv)}\n".encode())
        out.flush()
        workdir = self.dir / "cwd"
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            return subprocess.Popen(
                wrapped, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=workdir, env=env, preexec_fn=die_with_parent, start_new_session=True)
        finally:
            out.close()

    def _spawn(self) -> None:
        self.state.process = self._start_process(self.container)
        self.state.running_since = rfc3339()
        self.state.waiting_reason = None
        self.state.started = "startupProbe" not in self.container
        self.state.ready = False

    def _run_init_containers(self) -> bool:
        """Each init container to completion, in order, retried with back-off as a kubelet
        does; False when the pod is deleted first."""
        for container in self.pod["spec"].get("initContainers") or []:
            backoff = 1.0
            while not self.terminating.is_set():
                try:
                    process = self.state.init_process = self._start_process(container)
                except LookupError as exc:
                    self._wait_state("Init:ErrImageNeverPull", str(exc))
                    self.terminating.wait(5.0)
                    continue
                except (ConfigError, ValueError) as exc:
                    self._wait_state("Init:CreateContainerConfigError", str(exc))
                    self.terminating.wait(2.0)
                    continue
                self._wait_state("PodInitializing", f"init container {container['name']} running")
                while process.poll() is None and not self.terminating.is_set():
                    self.terminating.wait(0.2)
                if self.terminating.is_set():
                    break
                if process.returncode == 0:
                    break
                self._wait_state("Init:CrashLoopBackOff",
                                 f"init container {container['name']} exited "
                                 f"{process.returncode}; back-off {backoff:.0f}s")
                self.terminating.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
            if self.terminating.is_set():
                return False
        self.state.initialized = True
        return True

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.runtime.network.add_pod(self.ip)
        except PodNetworkError as exc:
            self.runtime.errors.append(f"pod {self.key}: {exc}")
            self._wait_state("CreatePodSandboxError", str(exc))
        else:
            try:
                self._run_containers()
            finally:
                self.done.wait()
        # The sandbox goes once no container runs (a finished pod's too, as a kubelet does).
        self.runtime.network.remove_pod(self.ip)

    def _run_containers(self) -> None:
        try:
            self._project_token()
        except ApiError as exc:
            self._wait_state("CreateContainerConfigError", f"service account token: {exc}")
            return
        if not self._run_init_containers():
            self.done.wait()
            return
        backoff = 1.0
        while not self.terminating.is_set():
            try:
                self._spawn()
            except LookupError as exc:
                self._wait_state("ErrImageNeverPull", str(exc))
                self.terminating.wait(5.0)
                continue
            except (ConfigError, ValueError) as exc:
                self._wait_state("CreateContainerConfigError", str(exc))
                self.terminating.wait(2.0)
                continue
            self.runtime.report(self)
            started_at = time.monotonic()
            reason = self._supervise()
            if self.terminating.is_set():
                break
            process = self.state.process
            assert process is not None
            if reason == "liveness":
                process.kill()
            code = process.wait()
            self.state.last_exit = {"terminated": {
                "exitCode": code if code >= 0 else 128 - code,
                "reason": "Error" if code else "Completed",
                "startedAt": self.state.running_since, "finishedAt": rfc3339()}}
            policy = self.pod["spec"].get("restartPolicy", "Always")
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                # A run-to-completion pod (a Job's, a helm test hook): it ends here.
                self.state.process, self.state.ready = None, False
                self.finished_phase = "Succeeded" if code == 0 else "Failed"
                self.runtime.report(self)
                self._finish()
                break
            self.state.restart_count += 1
            self.state.ready = False
            self.state.process = None
            if time.monotonic() - started_at > 60:
                backoff = 1.0
            self._wait_state("CrashLoopBackOff" if self.state.restart_count > 2 else "ContainerCreating",
                             f"back-off {backoff:.0f}s restarting failed container")
            self.terminating.wait(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)
        self.done.wait()
        self.state.ready = False

    def _wait_state(self, reason: str, message: str) -> None:
        self.state.waiting_reason, self.state.waiting_message = reason, message
        self.state.ready = False
        self.runtime.report(self)

    def _supervise(self) -> str:
        """Probe until the process exits ('exit'), liveness fails ('liveness') or the pod stops."""
        container = self.container
        startup, readiness = container.get("startupProbe"), container.get("readinessProbe")
        liveness = container.get("livenessProbe")
        failures = {"startup": 0, "readiness": 0, "liveness": 0}
        successes = 0
        next_due = {"startup": 0.0, "readiness": 0.0, "liveness": 0.0}
        begun = time.monotonic()
        process = self.state.process
        assert process is not None
        while not self.terminating.is_set():
            if process.poll() is not None:
                return "exit"
            now = time.monotonic()
            changed = False
            if not self.state.started and startup is not None:
                if now >= next_due["startup"] and now - begun >= startup.get("initialDelaySeconds", 0):
                    next_due["startup"] = now + startup.get("periodSeconds", 10)
                    if self._probe(startup):
                        self.state.started, changed = True, True
                    else:
                        failures["startup"] += 1
                        if failures["startup"] >= startup.get("failureThreshold", 3):
                            return "liveness"
            elif self.state.started:
                if readiness is None:
                    changed, self.state.ready = not self.state.ready, True
                elif now >= next_due["readiness"] and now - begun >= readiness.get("initialDelaySeconds", 0):
                    next_due["readiness"] = now + readiness.get("periodSeconds", 10)
                    if self._probe(readiness):
                        failures["readiness"] = 0
                        successes += 1
                        if not self.state.ready and successes >= readiness.get("successThreshold", 1):
                            self.state.ready, changed = True, True
                    else:
                        successes = 0
                        failures["readiness"] += 1
                        if self.state.ready and failures["readiness"] >= readiness.get("failureThreshold", 3):
                            self.state.ready, changed = False, True
                if liveness is not None and now >= next_due["liveness"] and (
                        now - begun >= liveness.get("initialDelaySeconds", 0)):
                    next_due["liveness"] = now + liveness.get("periodSeconds", 10)
                    if self._probe(liveness):
                        failures["liveness"] = 0
                    else:
                        failures["liveness"] += 1
                        if failures["liveness"] >= liveness.get("failureThreshold", 3):
                            log.warning("pod %s: liveness failed, restarting", self.key)
                            return "liveness"
            if changed:
                self.runtime.report(self)
            self.terminating.wait(0.05)
        return "terminating"

    def _port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in self.container.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ValueError(f"no container port named {port!r}")

    def _http_get(self, action: dict[str, Any], timeout: float) -> bool:
        url = f"http://{self.ip}:{self._port(action['port'])}{action.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
                return 200 <= response.status < 400
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _probe(self, probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            return self._http_get(probe["httpGet"], timeout)
        if "tcpSocket" in probe:
            try:
                with socket.create_connection((self.ip, self._port(probe["tcpSocket"]["port"])), timeout):
                    return True
            except OSError:
                return False
        log.warning("pod %s: unsupported probe %s", self.key, sorted(probe))
        return False

    # -- what the API sees -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        state = self.state
        ready = state.ready and not self.terminating.is_set()
        now = rfc3339()
        if state.process is not None and state.waiting_reason is None:
            current: dict[str, Any] = {"running": {"startedAt": state.running_since}}
        else:
            current = {"waiting": {"reason": state.waiting_reason or "ContainerCreating",
                                   "message": state.waiting_message}}
        container_status = {
            "name": state.name, "image": self.container["image"], "imageID": "",
            "ready": ready, "started": state.started and state.process is not None,
            "restartCount": state.restart_count, "state": current,
        }
        if state.last_exit is not None:
            container_status["lastState"] = state.last_exit
        condition = "True" if ready else "False"
        # Pending until the container first runs, as the kubelet reports it.
        phase = self.finished_phase or (
            "Running" if state.process is not None or state.restart_count else "Pending")
        if self.finished_phase is not None:
            current = state.last_exit or {}
            container_status["state"] = current
            container_status.pop("lastState", None)
        return {
            "phase": phase,
            "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "hostIP": self.runtime.node_ip, "hostIPs": [{"ip": self.runtime.node_ip}],
            "startTime": self.start_time,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.start_time},
                {"type": "Initialized", "status": "True" if state.initialized else "False",
                 "lastTransitionTime": self.start_time},
                {"type": "ContainersReady", "status": condition, "lastTransitionTime": now},
                {"type": "Ready", "status": condition, "lastTransitionTime": now},
            ],
            "containerStatuses": [container_status],
        }


# --------------------------------------------------------------------------------------- services


class ServiceProxy:
    """kube-proxy's userspace mode: a listener on each ClusterIP:port, round-robin over the
    Service's ready endpoints (the `kubernetes` Service: the apiserver)."""

    def __init__(self, apiserver: tuple[str, int]) -> None:
        self.apiserver = apiserver
        self.loop = asyncio.new_event_loop()
        self.listeners: dict[tuple[str, int], asyncio.base_events.Server] = {}
        self.backends: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._turn = itertools.count()
        self._thread = threading.Thread(target=self.loop.run_forever, name="service-proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        async def close() -> None:
            for server in self.listeners.values():
                server.close()
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def update(self, backends: dict[tuple[str, int], list[tuple[str, int]]]) -> None:
        asyncio.run_coroutine_threadsafe(self._update(backends), self.loop).result(5)

    async def _update(self, backends: dict[tuple[str, int], list[tuple[str, int]]]) -> None:
        self.backends = backends
        for address in list(self.listeners):
            if address not in backends:
                self.listeners.pop(address).close()
        for address in backends:
            if address not in self.listeners:
                self.listeners[address] = await asyncio.start_server(
                    lambda r, w, a=address: self._serve(a, r, w), *address, reuse_address=True)

    async def _serve(self, address: tuple[str, int], reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        candidates = self.backends.get(address) or []
        if not candidates:
            writer.close()  # no ready endpoint: refused, as kube-proxy's REJECT rule does
            return
        host, port = candidates[next(self._turn) % len(candidates)]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


def service_backends(services: list[dict[str, Any]], slices: list[dict[str, Any]],
                     apiserver: tuple[str, int], service_cidr: str
                     ) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """ClusterIP:port -> ready endpoint addresses, from Services and their EndpointSlices."""
    by_service: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for endpoint_slice in slices:
        owner = (endpoint_slice["metadata"].get("labels") or {}).get("kubernetes.io/service-name")
        if owner:
            by_service.setdefault((endpoint_slice["metadata"]["namespace"], owner), []).append(endpoint_slice)
    network = ipaddress.ip_network(service_cidr)
    backends: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for service in services:
        cluster_ip = service["spec"].get("clusterIP")
        if not cluster_ip or cluster_ip == "None" or ipaddress.ip_address(cluster_ip) not in network:
            continue
        key = (service["metadata"]["namespace"], service["metadata"]["name"])
        for port in service["spec"].get("ports") or []:
            if key == ("default", "kubernetes"):
                backends[(cluster_ip, port["port"])] = [apiserver]
                continue
            targets = []
            for endpoint_slice in by_service.get(key, []):
                numbers = [p["port"] for p in endpoint_slice.get("ports") or []
                           if p.get("name", "") == port.get("name", "") and p.get("port")]
                for endpoint in endpoint_slice.get("endpoints") or []:
                    if (endpoint.get("conditions") or {}).get("ready") is False:
                        continue
                    targets += [(endpoint["addresses"][0], number) for number in numbers]
            backends[(cluster_ip, port["port"])] = sorted(set(targets))
    return backends


def hosts_file_text(services: list[dict[str, Any]], slices: list[dict[str, Any]] = (),
                    cluster_domain: str = "cluster.local") -> str:
    """/etc/hosts lines resolving Service names as cluster DNS would: a ClusterIP Service to its
    ClusterIP, a headless one to its ready endpoints' addresses."""
    ready: dict[tuple[str, str], list[str]] = {}
    for endpoint_slice in slices:
        owner = (endpoint_slice["metadata"].get("labels") or {}).get("kubernetes.io/service-name")
        for endpoint in endpoint_slice.get("endpoints") or []:
            if owner and (endpoint.get("conditions") or {}).get("ready") is not False:
                ready.setdefault((endpoint_slice["metadata"]["namespace"], owner), []).append(
                    endpoint["addresses"][0])
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    for service in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        cluster_ip = service["spec"].get("clusterIP")
        if not cluster_ip:
            continue
        name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
        names = " ".join([f"{name}.{namespace}.svc.{cluster_domain}", f"{name}.{namespace}.svc",
                          f"{name}.{namespace}"])
        addresses = sorted(set(ready.get((namespace, name), []))) if cluster_ip == "None" else [cluster_ip]
        lines += [f"{address}\t{names}" for address in addresses]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- runtime


class KubeletRuntime:
    """Plays the kubelet for every pod bound to `nodes`, and kube-proxy for every Service."""

    def __init__(self, env: K8sEnv, nodes: tuple[str, ...], workdir: Path,
                 images: dict[str, Image] | None = None, node_ip: str = "127.240.0.10") -> None:
        if not env.process_pods:
            raise ValueError("start the environment with process_pods=True (kwok must leave pods alone)")
        self.env = env
        self.nodes = set(nodes)
        self.workdir = workdir
        self.images = images if images is not None else default_images()
        self.node_ip = node_ip
        self.kube = Kube(load_connection(str(env.kubeconfig)))
        self.workers: dict[tuple[str, str], PodWorker] = {}
        self.hosts_file = workdir / "hosts"
        self._hosts_text = ""
        self.network = PodNetwork(env.pod_cidr, env.service_cidr)
        self._addresses = (str(ip) for ip in ipaddress.ip_network(env.pod_cidr).hosts()
                           if str(ip) != self.network.gateway)
        apiserver_port = int(env.server.rsplit(":", 1)[1])
        self.apiserver = ("127.0.0.1", apiserver_port)
        self.proxy = ServiceProxy(self.apiserver)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watchers = [Kube(load_connection(str(env.kubeconfig))) for _ in WATCHED]
        self._report_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self.errors: list[str] = []

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(hosts_file_text([]))
        self.network.start()
        self.proxy.start()
        for path, kube in zip(WATCHED, self._watchers, strict=True):
            threading.Thread(target=self._watch, args=(kube, path), name=f"watch-{path}",
                             daemon=True).start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)
        for kube in self._watchers:
            kube.close()  # ends the watch streams
        for worker in list(self.workers.values()):
            worker.terminate(0.0)
        for worker in list(self.workers.values()):
            worker.done.wait(10)
        self.proxy.stop()
        self.network.stop()  # every pod's namespace and veth, the bridge, the Services' route
        self.kube.close()

    # -- for tests ----------------------------------------------------------------------------------
    def worker(self, namespace: str, name: str) -> PodWorker:
        return self.workers[(namespace, name)]

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        return self.worker(namespace, name).kill(sig)

    def enter(self, namespace: str, name: str) -> list[str]:
        """The argv prefix that runs a command inside the pod's network namespace."""
        return self.worker(namespace, name).enter()

    @property
    def host_ip(self) -> str:
        """The host's address on the pod network (the pods' gateway): where a test serves
        something pods must reach without a Service (they cannot reach the host's 127.0.0.1)."""
        return self.network.gateway

    def pids(self) -> dict[tuple[str, str], int]:
        return {key: w.state.process.pid for key, w in self.workers.items()
                if w.state.process is not None and w.state.process.poll() is None}

    def log_tail(self, namespace: str, name: str, lines: int = 40) -> str:
        path = self.worker(namespace, name).state.log_path
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- the loop -----------------------------------------------------------------------------------
    def report(self, worker: PodWorker) -> None:
        namespace, name = worker.key
        with self._report_lock:
            try:
                self.kube.merge_patch(path_for("v1", "pods", namespace, name, "status"),
                                      {"metadata": {"uid": worker.uid}, "status": worker.status()})
            except ApiError as exc:
                if exc.status not in (404, 409, 422):
                    log.warning("status of pod %s/%s: %s", namespace, name, exc)

    def wake(self) -> None:
        self._wake.set()

    def _watch(self, kube: Kube, path: str) -> None:
        """Wakes the loop on every event of one collection; the loop lists afresh, so the events'
        contents and a stream's reconnects (which replay the collection as ADDED) do not matter."""
        while not self._stop.is_set():
            try:
                with kube._http.stream("GET", path, params={"watch": "true",
                                       "timeoutSeconds": WATCH_TIMEOUT_S}, timeout=None) as response:
                    for _ in response.iter_lines():
                        self._wake.set()
            except Exception as exc:  # the apiserver restarting, or stop() closing the client
                if self._stop.is_set():
                    return
                log.debug("watch %s: %s", path, exc)
                self._stop.wait(0.5)
            self._wake.set()  # a reconnect may have missed events

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.sync()
            except Exception as exc:  # an apiserver hiccup: next round
                self.errors.append(repr(exc))
                log.warning("kubelet sync: %s", exc)
                self._stop.wait(0.2)
            self._wake.wait(RESYNC_S)

    def sync(self) -> None:
        pods = [p for p in self.kube.list("/api/v1/pods") if p["spec"].get("nodeName") in self.nodes]
        seen = set()
        for pod in pods:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            seen.add(key)
            worker = self.workers.get(key)
            if worker is not None and worker.uid != pod["metadata"]["uid"]:
                worker.terminate(0.0)  # same name, new pod (a StatefulSet's): the old one goes
                self.workers.pop(key)
                worker = None
            if pod["metadata"].get("deletionTimestamp"):
                if worker is None:
                    self._final_delete(pod)
                    continue
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                worker.terminate(float(30 if grace is None else grace))
                if worker.done.is_set():
                    self._final_delete(pod)
                    self.workers.pop(key, None)
                continue
            if worker is None:
                worker = PodWorker(self, pod, next(self._addresses))
                self.workers[key] = worker
                self.report(worker)
                worker.start()
        for key in [k for k in self.workers if k not in seen]:
            self.workers.pop(key).terminate(0.0)
        self._sync_services()

    def _final_delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiError):
            self.kube.request("DELETE", path_for("v1", "pods", meta["namespace"], meta["name"]),
                              {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})

    def _sync_services(self) -> None:
        services = self.kube.list("/api/v1/services")
        slices = self.kube.list("/apis/discovery.k8s.io/v1/endpointslices")
        text = hosts_file_text(services, slices)
        if text != self._hosts_text:
            # Rewritten in place (same inode): the pods' bind mounts see the new contents.
            with open(self.hosts_file, "w") as out:
                out.write(text)
            self._hosts_text = text
        self.proxy.update(service_backends(services, slices, self.apiserver, self.env.service_cidr))


def start_runtime(env: K8sEnv, workdir: Path, nodes: tuple[str, ...]) -> KubeletRuntime:
    runtime = KubeletRuntime(env, nodes, workdir)
    runtime.start()
    return runtime


__all__ = ["Image", "KubeletRuntime", "ServiceProxy", "expand", "find_image", "hosts_file_text",
           "service_backends", "start_runtime"]
