"""`kvscale router` with no --host listens on every address: 127.0.0.1 and ::1 alike (what
`kubectl port-forward` dials inside a router pod), and only the given host with --host."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request

from kvscale.processes import free_port, wait_until


def status(host: str, port: int) -> int | None:
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code  # 503 with no healthy replica: still the router answering
    except OSError:
        return None


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def start_router(port: int, *extra: str) -> subprocess.Popen:
    # A replica nobody listens on: the router starts, and its /health says it has none.
    dead = f"http://127.0.0.1:{free_port()}"
    return subprocess.Popen([sys.executable, "-m", "kvscale", "router", "--replicas", dead,
                             "--port", str(port), "--health-interval", "60", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_router_without_host_answers_on_ipv4_and_ipv6_loopback():
    port = free_port()
    proc = start_router(port)
    try:
        wait_until(lambda: status("127.0.0.1", port) is not None or proc.poll() is not None, 60,
                   interval=0.2, what="the router answering")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert status("127.0.0.1", port) is not None
        assert status("::1", port) is not None
    finally:
        stop(proc)


def test_router_with_host_binds_only_it():
    port = free_port()
    proc = start_router(port, "--host", "127.0.0.1")
    try:
        wait_until(lambda: status("127.0.0.1", port) is not None or proc.poll() is not None, 60,
                   interval=0.2, what="the router answering")
        assert status("127.0.0.1", port) is not None
        assert not connects("::1", port)
    finally:
        stop(proc)
