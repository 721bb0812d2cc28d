"""Servers listen on every address, IPv4 and IPv6, unless a host is given: one dual-stack socket
for the serve helper both `kvscale serve` and `kvscale router` use (kvscale.drain.serve)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from kvscale.listen import all_addresses_host, bind_all_addresses
from kvscale.processes import free_port, wait_until

LOOPBACKS = ("127.0.0.1", "::1")


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_one_socket_takes_ipv4_and_ipv6():
    sock = bind_all_addresses(0)
    try:
        sock.listen()
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        port = sock.getsockname()[1]
        for host in LOOPBACKS:
            assert connects(host, port), host
    finally:
        sock.close()


def test_a_taken_port_is_an_error_not_a_fallback():
    taken = bind_all_addresses(0)
    try:
        taken.listen()
        with pytest.raises(OSError):
            bind_all_addresses(taken.getsockname()[1])
    finally:
        taken.close()


def test_hosts_that_bind_by_name_get_the_ipv6_wildcard():
    assert all_addresses_host() == "::"


SERVE = textwrap.dedent("""
    import sys
    from kvscale.drain import Drain, serve

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["client"][0].encode()})

    host = sys.argv[2] if len(sys.argv) > 2 else None
    serve(app, Drain(), host=host, port=int(sys.argv[1]), shutdown_timeout_s=1, name="test")
""")


def run_serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SERVE, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def get(host: str, port: int) -> str:
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
        return response.read().decode()


def test_serve_without_a_host_answers_on_127_0_0_1_and_ipv6_loopback():
    port = free_port()
    proc = run_serve(str(port))
    try:
        wait_until(lambda: connects("127.0.0.1", port) or proc.poll() is not None, 30, interval=0.1,
                   what="the server listening")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        # IPv4 clients arrive on the IPv6 socket as mapped addresses.
        assert get("127.0.0.1", port) == "::ffff:127.0.0.1"
        assert get("::1", port) == "::1"
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_with_a_host_binds_only_it():
    port = free_port()
    proc = run_serve(str(port), "127.0.0.1")
    try:
        wait_until(lambda: connects("127.0.0.1", port) or proc.poll() is not None, 30, interval=0.1,
                   what="the server listening")
        assert get("127.0.0.1", port) == "127.0.0.1"
        assert not connects("::1", port)
    finally:
        proc.terminate()
        proc.wait(10)


NO_IPV6_POD = textwrap.dedent("""
    import socket
    from kvscale.listen import bind_all_addresses
    sock = bind_all_addresses(0)
    sock.listen()
    socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=2).close()
    print("ipv4 answered")
""")


def test_a_pod_with_ipv6_disabled_is_still_served_over_ipv4():
    """A network namespace of its own with IPv6 switched off, as some clusters' pods have (root,
    as the process runtime's tests need anyway)."""
    script = ("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 "
              "net.ipv6.conf.lo.disable_ipv6=1 && ip link set lo up && "
              f'exec "{sys.executable}" -c "$0"')
    done = subprocess.run(["unshare", "--net", "sh", "-c", script, NO_IPV6_POD],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "ipv4 answered" in done.stdout, done.stderr
