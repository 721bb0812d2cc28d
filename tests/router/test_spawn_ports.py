"""The test launcher itself: a child that loses its port between ``free_port`` and its bind (to
another xdist worker) is started again on another port rather than failing the test."""

from __future__ import annotations

import socket

import httpx

from tests.router.conftest import BLOCK_SIZE, spawn


def test_a_child_whose_port_was_taken_is_started_on_another():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        router = spawn(["router", "--host", "127.0.0.1", "--port", str(taken), "--policy", "round-robin",
                        "--block-size", str(BLOCK_SIZE), "--replicas", "http://127.0.0.1:9"],
                       taken, "router", health_path="/ping", timeout=120)
        try:
            assert router.port != taken
            assert httpx.get(f"{router.url}/ping", timeout=10).status_code == 200
        finally:
            router.stop()
