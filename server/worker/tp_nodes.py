"""Tensor-parallel ranks on other nodes: the leader's connection to each headless node.

With ``--nnodes M``, node 0 (the leader) runs the engine, rank 0 and its local ranks as
tp_group.py does; node R runs ranks R*k .. R*k+k-1 (k = N/M) under ``kvscale serve --headless``
(tp_headless.py). A pipe cannot reach another node, so each node holds one TCP connection to the
leader, on the port after ``--master-port``, and gets down it the same pickled step messages the
local ranks get down their pipes; its first rank relays them to its other ranks. The ranks
themselves meet at torch.distributed's TCP rendezvous on ``--master-addr:--master-port``.

Unpickling is running code, so a connection is used only once both ends prove they hold
$KVSCALE_TP_AUTHKEY: multiprocessing.connection's HMAC challenge, both ways, as its Listener and
Client run it. Their own sockets are not used because neither bounds its waits: the leader's
accept here takes a deadline, and every handshake a receive timeout, so a peer that connects and
says nothing cannot hold the start. What a peer controls is bounded: the leader admits one
connection per expected node (another claiming a node already in, or a wrong key, is refused and
the leader keeps waiting), then closes its listening socket, so a later connection is refused by
the kernel; messages have a maximum size each way.

Failure: the leader reads nothing from a node after start but its failure message, so a node's
connection that turns readable has failed or closed (``NodeLinks.gone``); the engine's next step
fails naming it (tp_group.RankFailed). TCP keepalive notices a node that vanished without closing
(a partition); a send blocked on a node that stopped reading fails after the collective timeout.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Connection,
    answer_challenge,
    deliver_challenge,
)
from multiprocessing.connection import wait as wait_readable
from typing import Any

from kvscale.listen import bind_all_addresses
from kvscale.server.config import TP_AUTHKEY_ENV

logger = logging.getLogger(__name__)

# A step message (ids, positions, block tables of one step) is far below this.
MAX_STEP_BYTES = 256 * 2**20
# What a node sends the leader: hello, ready, or a failure's text.
MAX_REPLY_BYTES = 64 * 2**10
MAX_FAILURE_CHARS = 4000
# How long one connection's handshake may take, each way.
HANDSHAKE_TIMEOUT_S = 10.0
# A dead peer that never closed its connection is noticed after about 10 + 3 * 5 s idle.
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 10), (socket.TCP_KEEPINTVL, 5), (socket.TCP_KEEPCNT, 3))


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks run where: ``size`` ranks over ``nnodes`` nodes, this one ``node_rank``."""

    size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    def node_ranks(self, node: int) -> range:
        k = self.ranks_per_node
        return range(node * k, node * k + k)

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    @property
    def step_port(self) -> int:
        return self.master_port + 1

    def node_name(self, node: int) -> str:
        ranks = self.node_ranks(node)
        return f"node {node} ({f'ranks {ranks[0]}-{ranks[-1]}' if len(ranks) > 1 else f'rank {ranks[0]}'})"


@dataclass(frozen=True)
class NodeStart:
    """What the leader tells every node once all are in: its resolved settings, which the nodes
    take (a node's own `auto` dtype could differ), and the model's shape to check theirs by."""

    dtype: Any  # torch.dtype
    device_type: str
    block_size: int
    kv_cache_dtype: Any  # torch.dtype
    model: str  # repr of the model's DecoderSpec


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """An OS-level receive timeout (0: none) on a blocking socket: multiprocessing's Connection
    reads the descriptor itself, so a Python-level timeout would not reach it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _connection(sock: socket.socket, *, send_timeout_s: float = 0.0) -> Connection:
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout_s))
    _set_recv_timeout(sock, HANDSHAKE_TIMEOUT_S)
    return Connection(sock.detach())


def _recv_timeout(conn: Connection, seconds: float) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as view:
        _set_recv_timeout(view, seconds)


def _recv(conn: Connection, limit: int) -> Any:
    return pickle.loads(conn.recv_bytes(limit))


class NodeLinks:
    """The leader's connections to the other nodes, and what it knows of their failures."""

    def __init__(self, layout: NodeLayout, conns: dict[int, tuple[Connection, str]]) -> None:
        self.nodes = sorted(conns)
        self.conns = [conns[node][0] for node in self.nodes]
        self.names = [f"{layout.node_name(node)} on {conns[node][1]}" for node in self.nodes]
        self.failures: dict[int, str] = {}

    def live(self) -> list[Connection]:
        return [conn for i, conn in enumerate(self.conns) if i not in self.failures]

    def gone(self) -> list[str]:
        """The nodes known to have failed: those whose connection turned readable say why."""
        for conn in wait_readable(self.live(), 0):
            i = self.conns.index(conn)  # type: ignore[arg-type]
            try:
                message = _recv(conn, MAX_REPLY_BYTES)  # type: ignore[arg-type]
                why = f"failed: {message[1]}" if message[0] == "failed" else f"sent {message[0]!r}"
            except (EOFError, OSError) as exc:
                why = f"connection closed ({type(exc).__name__})"
            except Exception as exc:  # noqa: BLE001 - a garbled message is a failed node too
                why = f"sent a message that does not read ({exc})"
            self.failures[i] = f"{self.names[i]} {why}"
        return [self.failures[i] for i in sorted(self.failures)]


def accept_nodes(layout: NodeLayout, start: NodeStart, timeout_s: float, send_timeout_s: float) -> NodeLinks:
    """The leader's side: wait up to ``timeout_s`` for every other node to connect and prove the
    key ($KVSCALE_TP_AUTHKEY, checked by config.multi_node_refusal), then tell them all to start."""
    authkey = os.environ[TP_AUTHKEY_ENV].encode()
    expected = set(range(1, layout.nnodes))
    admitted: dict[int, tuple[Connection, str]] = {}
    try:
        listener = bind_all_addresses(layout.step_port)
    except OSError as exc:
        raise RuntimeError(f"cannot listen for the other nodes on port {layout.step_port} (--master-port + 1): "
                           f"{exc}") from exc
    try:
        listener.listen(len(expected))
        logger.info("kvscale engine: waiting for nodes %s on port %d", sorted(expected), layout.step_port)
        deadline = time.monotonic() + timeout_s
        while set(admitted) != expected:
            # A node admitted then gone (restarted while others were late) may come again.
            for node, (conn, _) in list(admitted.items()):
                if conn.poll(0):
                    logger.warning("kvscale engine: %s closed its connection before the start",
                                   layout.node_name(node))
                    conn.close()
                    del admitted[node]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = ", ".join(str(n) for n in sorted(expected - set(admitted)))
                raise RuntimeError(f"tensor-parallel node(s) {missing} did not connect to port {layout.step_port} "
                                   f"within {timeout_s:.0f} s (each runs `kvscale serve --headless --node-rank R` "
                                   f"with --master-addr this node and the same KVSCALE_TP_AUTHKEY)")
            listener.settimeout(min(remaining, 1.0))
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            try:
                node, conn, host = _admit(sock, layout, authkey, admitted, send_timeout_s)
            except (AuthenticationError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
                logger.warning("kvscale engine: refused a tensor-parallel connection from %s: %s: %s",
                               peer[0], type(exc).__name__, exc)
                continue
            admitted[node] = (conn, host)
            logger.info("kvscale engine: %s joined from %s (%s)", layout.node_name(node), peer[0], host)
    except BaseException:
        for conn, _ in admitted.values():
            conn.close()
        raise
    finally:
        listener.close()  # no more connections: the kernel refuses any further one
    # The leader reads a node only once its connection is readable: the handshake's receive
    # timeout stays, so a message that stops halfway fails instead of holding the engine.
    links = NodeLinks(layout, admitted)
    for name, conn in zip(links.names, links.conns, strict=True):
        try:
            conn.send_bytes(pickle.dumps(("welcome", start)))
        except OSError as exc:
            raise RuntimeError(f"tensor-parallel {name} went before the start: {exc}") from exc
    return links


def _admit(sock: socket.socket, layout: NodeLayout, authkey: bytes,
           admitted: dict[int, tuple[Connection, str]], send_timeout_s: float) -> tuple[int, Connection, str]:
    conn = _connection(sock, send_timeout_s=send_timeout_s)
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        hello = _recv(conn, MAX_REPLY_BYTES)
        if not (isinstance(hello, tuple) and len(hello) == 5 and hello[0] == "hello"):
            raise ValueError(f"not a node's hello: {str(hello)[:200]}")
        _, node, size, nnodes, host = hello
        why = None
        if (size, nnodes) != (layout.size, layout.nnodes):
            why = (f"it has --tensor-parallel-size {size} --nnodes {nnodes}, the leader "
                   f"{layout.size} and {layout.nnodes}")
        elif node not in range(1, layout.nnodes):
            why = f"--node-rank {node} is not one of 1..{layout.nnodes - 1}"
        elif node in admitted:
            why = f"node {node} is already in"
        if why is not None:
            conn.send_bytes(pickle.dumps(("refused", why)))
            raise ValueError(why)
    except BaseException:
        conn.close()
        raise
    return node, conn, str(host)[:200]


def connect_to_leader(layout: NodeLayout, authkey: bytes, deadline: float) -> Connection:
    """A node's side: connect to the leader and prove the key, retrying until ``deadline``
    (time.monotonic()) while the leader is not up yet; a wrong key is not retried."""
    address = (layout.master_addr, layout.step_port)
    while True:
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(remaining, HANDSHAKE_TIMEOUT_S)))
            conn = _connection(sock)
            try:
                answer_challenge(conn, authkey)
                deliver_challenge(conn, authkey)
                conn.send_bytes(pickle.dumps(("hello", layout.node_rank, layout.size, layout.nnodes,
                                              socket.gethostname())))
            except BaseException:
                conn.close()
                raise
            _recv_timeout(conn, 0)
            return conn
        except AuthenticationError as exc:
            raise RuntimeError(f"the leader at {address[0]}:{address[1]} refused this node's KVSCALE_TP_AUTHKEY "
                               f"(not the leader's): {exc}") from exc
        except (OSError, EOFError) as exc:  # not listening yet, its name not resolvable yet, busy
            if time.monotonic() + 1.0 > deadline:
                raise RuntimeError(f"could not reach the leader at {address[0]}:{address[1]} (--master-addr, "
                                   f"--master-port + 1) in time: {type(exc).__name__}: {exc}") from exc
            time.sleep(1.0)


def await_start(conn: Connection, deadline: float) -> NodeStart:
    """Wait until the leader has every node and says start; its settings."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise RuntimeError("the leader did not start the group in time (another node missing?)")
    try:
        reply = _recv(conn, MAX_STEP_BYTES)
    except EOFError as exc:
        raise RuntimeError("the leader closed the connection before the start") from exc
    if reply[0] == "refused":
        raise RuntimeError(f"the leader refused this node: {reply[1]}")
    start: NodeStart = reply[1]
    return start


def send_failure(conn: Connection, exc: BaseException) -> None:
    """Tell the leader why this node stops (best effort: it may be gone already)."""
    try:
        conn.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}"[:MAX_FAILURE_CHARS])))
    except OSError:
        pass
