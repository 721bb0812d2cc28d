"""The chaos soak's platform: what `kvscale up` starts (Redis, N replicas publishing to it) plus
two routers, each a child that the soak can kill and start again. With ``api_key`` the routers
require it (the hostile soak's unauthenticated clients need a router that checks a key); the
replicas behind them stay open, as on a private network."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from bench.common import redis_server_binary
from kvscale.processes import free_port
from kvscale.router.cli_up import Child, Stack

KVSCALE = [sys.executable, "-m", "kvscale"]
ROUTERS = ("router-a", "router-b")


class Platform:
    def __init__(self, replicas: int, blocks: int, kv_offloading_size: float = 0.0,
                 api_key: str | None = None, replica_args: tuple[str, ...] = ()) -> None:
        self.stack = Stack()
        self.api_key = api_key
        self.replica_args = replica_args
        self.blocks = blocks
        self.kv_offloading_size = kv_offloading_size
        self.redis_port = free_port()
        self.redis: Child | None = None
        self.replicas: dict[str, Child] = {}
        self.replica_ports: dict[str, int] = {}
        self.routers: dict[str, Child] = {}
        self.router_ports: dict[str, int] = {}
        self.names = [f"r{i}" for i in range(replicas)]
        # The replicas share the machine's cores: more OpenMP threads than cores in all would
        # make every replica wait at each layer for descheduled threads of the others.
        self.threads_per_replica = max(1, len(os.sched_getaffinity(0)) // replicas)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_redis(self) -> None:
        binary = redis_server_binary()
        self.redis = self.stack.spawn("redis", [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                               "--save", "", "--appendonly", "no", "--dir", self.stack.logdir],
                                      self.redis_url, None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def start_replica(self, name: str) -> Child:
        port = self.replica_ports.setdefault(name, free_port())
        url = f"http://127.0.0.1:{port}"
        child = self.stack.spawn(name, KVSCALE + [
            "serve", "--host", "127.0.0.1", "--port", str(port), "--redis", self.redis_url, "--replica-id", name,
            "--num-gpu-blocks-override", str(self.blocks), "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-offloading-size", str(self.kv_offloading_size),
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *self.replica_args],
            url, f"{url}/health",
            env_extra={"OMP_NUM_THREADS": str(self.threads_per_replica)})
        self.replicas[name] = child
        return child

    def start_router(self, name: str) -> Child:
        port = self.router_ports.setdefault(name, free_port())
        url = f"http://127.0.0.1:{port}"
        urls = ",".join(f"http://127.0.0.1:{self.replica_ports[n]}" for n in self.names)
        child = self.stack.spawn(name, KVSCALE + [
            "router", "--host", "127.0.0.1", "--port", str(port), "--replicas", urls, "--redis", self.redis_url,
            "--health-interval", "0.5", "--log-level", "warning"], url, f"{url}/metrics",
            # The key by environment, not argv: Stack.spawn's rule for secrets.
            env_extra={"KVSCALE_API_KEY": self.api_key} if self.api_key else None)
        self.routers[name] = child
        return child

    def start(self, timeout: float) -> None:
        self.start_redis()
        for name in self.names:
            self.start_replica(name)
        self.stack.wait_healthy(list(self.replicas.values()), timeout)
        for name in ROUTERS:
            self.start_router(name)
        self.stack.wait_healthy(list(self.routers.values()), timeout)

    def client_headers(self) -> dict[str, str]:
        """What an honest client sends the routers."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def router_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.router_ports[n]}" for n in ROUTERS]

    def replica_id_of(self, name: str) -> str:
        return name

    def rss_mib(self, name: str) -> float | None:
        child = self.replicas.get(name) or self.routers.get(name)
        if child is None or not child.alive():
            return None
        for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None
