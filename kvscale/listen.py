"""Where a server listens: every address of its pod unless told one.

A pod's processes are reached on its pod IP (Services, probes, other pods) and on localhost
(`kubectl port-forward` and `kubectl exec ... curl localhost` dial inside the pod's network
namespace). So, like vLLM with no `--host`, `kvscale serve`, `kvscale router` and the operator's
metrics endpoint listen on every address, IPv4 and IPv6: one socket on `::` with IPV6_V6ONLY off
takes both families (IPv4 clients appear as ::ffff:a.b.c.d). A kernel or pod without IPv6 gets
0.0.0.0 instead. An explicit host is bound as given, and only it.
"""

from __future__ import annotations

import errno
import socket

ALL_IPV6 = "::"
ALL_IPV4 = "0.0.0.0"
# IPv6 is absent from this kernel (ipv6.disable=1) or from this pod's network.
_NO_IPV6 = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}


def _listening(family: socket.AddressFamily, host: str, port: int, dual_stack: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # What uvicorn and asyncio set too: a restarted server rebinds at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            # Set, not left to net.ipv6.bindv6only, whose default a node may have changed.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_all_addresses(port: int) -> socket.socket:
    """A TCP socket bound to `port` on every IPv4 and IPv6 address (0.0.0.0 without IPv6)."""
    try:
        return _listening(socket.AF_INET6, ALL_IPV6, port, dual_stack=True)
    except OSError as exc:
        if exc.errno not in _NO_IPV6:
            raise  # EADDRINUSE and the like: the caller's problem, whatever the family
    return _listening(socket.AF_INET, ALL_IPV4, port, dual_stack=False)


def all_addresses_host() -> str:
    """The wildcard to hand a server that binds by name: "::" where IPv6 works, else "0.0.0.0".

    For servers that take a host, not a socket (the operator's metrics): they leave IPV6_V6ONLY
    to the kernel, whose default (net.ipv6.bindv6only=0) makes "::" take IPv4 too.
    """
    try:
        _listening(socket.AF_INET6, ALL_IPV6, 0, dual_stack=True).close()
    except OSError:
        return ALL_IPV4
    return ALL_IPV6


__all__ = ["ALL_IPV4", "ALL_IPV6", "all_addresses_host", "bind_all_addresses"]
