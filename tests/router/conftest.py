"""Real services for the router tests: Debian's redis-server and `kvscale serve` replica processes
on free loopback ports. A missing binary fails the test (never skips)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

# fair_queue_helpers.py next to this file; with --import-mode=importlib it is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvscale.processes import free_port, wait_for_port

REPO = Path(__file__).resolve().parents[2]
KVSCALE = [sys.executable, "-m", "kvscale"]
MODEL = "smollm2-135m-instruct"


@dataclass
class RedisServer:
    port: int
    workdir: str
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make system-deps installs Debian's redis-server)"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 10, what="redis-server")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(free_port(), str(tmp_path))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory):
    server = RedisServer(free_port(), str(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.kill()


@dataclass
class Proc:
    proc: subprocess.Popen
    port: int
    log_path: str
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _env(overrides: dict[str, str | None] | None = None) -> dict:
    """The test environment's variables; an override of None removes that variable."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# How often a start that lost its port is retried on another: ``free_port`` probes a port, the
# child binds it seconds later (after its imports), and another xdist worker can take it between.
PORT_RETRIES = 3


def spawn(args: list[str], port: int, name: str, health_path: str = "/health", timeout: float = 240,
          env: dict[str, str | None] | None = None) -> Proc:
    """Start `kvscale ARGS` and wait until ``health_path`` answers 200; ``env`` overrides variables.
    A child that exits because ``--port`` was taken meanwhile is started again on another port."""
    for attempt in range(PORT_RETRIES + 1):
        try:
            return _spawn_once(args, port, name, health_path, timeout, env)
        except PortTaken:
            if attempt == PORT_RETRIES or "--port" not in args:
                raise
            port = free_port()
            args = [*args]
            args[args.index("--port") + 1] = str(port)
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """The child exited because its port was bound by another process first."""


def _spawn_once(args: list[str], port: int, name: str, health_path: str, timeout: float,
                env: dict[str, str | None] | None) -> Proc:
    log_fd, log_path = tempfile.mkstemp(prefix=f"kvscale-{name}-", suffix=".log")
    proc = subprocess.Popen(KVSCALE + args, stdout=log_fd, stderr=subprocess.STDOUT, env=_env(env), cwd=str(REPO))
    os.close(log_fd)
    handle = Proc(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = handle.log_tail()
            error = PortTaken if "address already in use" in tail.lower() else RuntimeError
            raise error(f"{name} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{handle.url}{health_path}", timeout=1.0).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    handle.stop(signal.SIGKILL)
    raise TimeoutError(f"{name} not healthy after {timeout}s:\n{handle.log_tail()}")


# Small KV pools so a few prompts fill them and eviction happens; short everything for 2 CPU cores.
REPLICA_BLOCKS = 64
BLOCK_SIZE = 16


def spawn_replica(redis_url: str | None, name: str, num_blocks: int = REPLICA_BLOCKS, extra: list[str] | None = None) -> Proc:
    port = free_port()
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", "512", "--max-num-seqs", "8"]
    if redis_url:
        args += ["--redis", redis_url, "--replica-id", name]
    return spawn(args + (extra or []), port, name)


def spawn_router(replica_urls: list[str] | None, redis_url: str | None, policy: str = "prefix-affinity",
                 extra: list[str] | None = None, health_path: str = "/health",
                 env: dict[str, str | None] | None = None) -> Proc:
    """A router over static replica URLs, or (``replica_urls`` None) whatever ``extra`` discovers."""
    port = free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--block-size", str(BLOCK_SIZE), "--health-interval", "0.5"]
    if replica_urls is not None:
        args += ["--replicas", ",".join(replica_urls)]
    if redis_url:
        args += ["--redis", redis_url]
    return spawn(args + (extra or []), port, "router", health_path=health_path, timeout=120, env=env)


def index_blocks(router_url: str, replica_id: str) -> int:
    """The blocks a router's prefix index holds for ``replica_id`` (its /health): a test routes by
    what Redis holds once this has caught up with it."""
    replicas = httpx.get(f"{router_url}/health", timeout=10).json()["replicas"]
    return next((r["index_blocks"] for r in replicas if r["id"] == replica_id), -1)


@pytest.fixture(scope="session")
def replicas(session_redis):
    """Two replicas of the bundled model publishing to the session's Redis."""
    started: list[Proc] = []
    try:
        for i in range(2):
            started.append(spawn_replica(session_redis.url, f"replica-{i}"))
        yield started
    finally:
        for proc in started:
            proc.stop()


class Launcher:
    """Starts replicas and routers for one test and stops whatever is left at its end."""

    def __init__(self) -> None:
        self.started: list[Proc] = []

    def replica(self, redis_url: str | None, name: str, **kwargs) -> Proc:
        proc = spawn_replica(redis_url, name, **kwargs)
        self.started.append(proc)
        return proc

    def router(self, replica_urls: list[str] | None, redis_url: str | None, **kwargs) -> Proc:
        proc = spawn_router(replica_urls, redis_url, **kwargs)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop(signal.SIGKILL if proc.extra.get("kill") else signal.SIGTERM)


@pytest.fixture
def launcher():
    launch = Launcher()
    yield launch
    launch.stop_all()


@pytest.fixture(scope="session")
def router_launcher():
    launch = Launcher()
    yield launch
    launch.stop_all()


class InProcessRouters:
    """`kvscale router`'s app, with the gate and body limits its CLI puts around it, served by
    uvicorn on a thread of the test process: no tokenizer (models=[]) and no subprocess."""

    def __init__(self) -> None:
        self.servers: list[tuple[object, object]] = []
        self.gates: dict[str, object] = {}  # URL -> its Admission, whose counts a test can wait on

    def start(self, config, limits=None) -> str:
        import threading

        import uvicorn

        from kvscale.drain import asgi_app
        from kvscale.request_limits import RequestLimits
        from kvscale.router.admission import gate
        from kvscale.router.app import build_app

        limits = limits or RequestLimits()
        port = free_port()
        app = asgi_app(build_app(config), limits, gate(config, limits))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.servers.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        self.gates[url] = app
        return url

    def stop_all(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True  # type: ignore[attr-defined]
            thread.join(10)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def in_process_routers():
    routers = InProcessRouters()
    yield routers
    routers.stop_all()
