"""`kvscale serve --headless --nnodes M --node-rank R`: one node's tensor-parallel ranks for a
leader elsewhere (docs/engine.md, "Ranks on several nodes"), and no API server.

The process connects to the leader (tp_nodes.py), waits until every node is in, and takes the
leader's resolved settings (dtype, device, block size, KV cache dtype). It is the node's first
rank, R*k (k = N/M), and spawns the node's other k - 1 as the leader spawns its own
(tp_group.py); each message the leader sends, it passes to them down their pipes before running it
itself. It exits non-zero as soon as the leader goes (end of file on the connection, or a
collective that fails), so a LeaderWorkerSet restarts the group, and when it cannot reach the
leader within tp_group.START_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import time
from datetime import timedelta
from pathlib import Path

from kvscale.server.config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    TP_AUTHKEY_ENV,
    multi_node_refusal,
)
from kvscale.server.worker import tp_nodes

logger = logging.getLogger("kvscale.serve.headless")


class LeaderGone(RuntimeError):
    """The leader closed its connection: the group is over."""


def layout_from_args(args: argparse.Namespace) -> tp_nodes.NodeLayout:
    return tp_nodes.NodeLayout(args.tensor_parallel_size or 1, args.nnodes or 1, args.node_rank or 0,
                               args.master_addr or DEFAULT_MASTER_ADDR, args.master_port or DEFAULT_MASTER_PORT)


def run_headless(args: argparse.Namespace) -> int:
    """`kvscale serve --headless`'s main: 2 for refused settings, 1 when the group ends abnormally,
    0 when the leader stopped it."""
    layout = layout_from_args(args)
    authkey = os.environ.get(TP_AUTHKEY_ENV)
    why = multi_node_refusal(layout.size, layout.nnodes, layout.node_rank, layout.master_addr, layout.master_port,
                             headless=True, authkey=authkey)
    if why is not None:
        print(f"kvscale serve: {why}", file=sys.stderr)
        return 2
    assert authkey is not None
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from kvscale.model_files import resolve_model_path
    from kvscale.server.worker.tp_group import START_TIMEOUT_S

    try:
        path = resolve_model_path(args.model)
    except FileNotFoundError as exc:
        print(f"kvscale serve: {exc}", file=sys.stderr)
        return 2
    name = layout.node_name(layout.node_rank)
    print(f"kvscale: headless {name} of {layout.nnodes}, for the leader at {layout.master_addr}:{layout.step_port}",
          flush=True)
    try:
        serve_node(layout, path, authkey.encode(), time.monotonic() + START_TIMEOUT_S)
    except LeaderGone as exc:
        print(f"kvscale serve --headless: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the traceback in the log, then one line
        logger.error("%s failed", name, exc_info=True)
        print(f"kvscale serve --headless: {name} stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("kvscale serve --headless: the leader stopped the group", flush=True)
    return 0


def serve_node(layout: tp_nodes.NodeLayout, path: Path, authkey: bytes, deadline: float) -> None:
    """Join the leader's group as this node's ranks and mirror its messages until it stops (returns)
    or goes (LeaderGone)."""
    import torch.distributed as dist

    from kvscale.server.worker.model_config import load_model_config
    from kvscale.server.worker.model_loader import model_spec
    from kvscale.server.worker.model_runner import ModelRunner
    from kvscale.server.worker.tp_group import (
        COLLECTIVE_TIMEOUT_S,
        RankProcesses,
        load_shard,
        rank_device,
        spawn_ranks,
    )
    from kvscale.server.worker.tp_messages import apply_message

    hf_config = load_model_config(str(path))
    conn = tp_nodes.connect_to_leader(layout, authkey, deadline)
    ranks = RankProcesses([], [])
    try:
        start = tp_nodes.await_start(conn, deadline)
        if start.model != repr(model_spec(hf_config)):
            raise RuntimeError(f"--model {path} is not the leader's model (its shape differs)")
        first, *others = layout.node_ranks(layout.node_rank)
        processes, pipes = spawn_ranks(path, range(first + 1, first + 1 + len(others)), layout.size,
                                       layout.init_method, start.dtype, start.device_type, start.block_size,
                                       start.kv_cache_dtype, layout.ranks_per_node)
        ranks = RankProcesses(processes, pipes, first_rank=first + 1)
        dist.init_process_group("nccl" if start.device_type == "cuda" else "gloo", init_method=layout.init_method,
                                rank=first, world_size=layout.size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        device = rank_device(start.device_type, 0)
        model = load_shard(path, hf_config, start.dtype, device, first, layout.size)
        runner = ModelRunner(model, start.block_size, start.dtype, device, kv_cache_dtype=start.kv_cache_dtype)
        ranks.wait_ready()
        conn.send_bytes(pickle.dumps(("ready",)))
        logger.info("kvscale: %s ready (pids %s, %s)", layout.node_name(layout.node_rank),
                    ",".join(str(pid) for pid in [os.getpid(), *(p.pid for p in processes)]), dist.get_backend())
        while True:
            try:
                data = conn.recv_bytes(tp_nodes.MAX_STEP_BYTES)
            except EOFError:
                raise LeaderGone("the leader closed the connection (it stopped or died)") from None
            if ranks.conns:
                ranks.send_bytes(data)
            try:
                if not apply_message(runner, pickle.loads(data)):
                    break
            except RuntimeError as exc:
                raise ranks.collective_failed(exc) from exc
    except BaseException as exc:
        tp_nodes.send_failure(conn, exc)
        raise
    finally:
        ranks.close()
        conn.close()
    dist.destroy_process_group()  # only after a clean stop: after a failure, a peer may never answer
