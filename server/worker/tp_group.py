"""Tensor parallel over torch.distributed: rank 0 is the engine's own model runner, ranks
1..N-1 are processes it spawns, each running the same model code on its shard (tp_shard.py,
tp_layers.py). gloo on CPU, NCCL on GPUs (one device a rank), the same code path. Ranks on
other nodes (``--nnodes``) take the same messages over tp_nodes.py's connections.

The scheduler runs once, in rank 0. Each forward pass rank 0 prepares (the flattened ids,
positions, attention metadata) goes to every other rank over a pipe before rank 0 runs it: a
pickled message of a few small tensors, cheaper than a collective and, unlike one, free to wait
without a timeout while the engine is idle. Then every rank runs the pass, meeting at the
collectives inside it; only rank 0 samples. Block copies, the KV cache's allocation (both groups'
where sliding-window layers have their own) and the host tier's (its slots and each step's copies
between the tiers) go the same way, so every rank's cache and host tier hold the same blocks, each
of its own heads (tp_messages.py).

A dead rank never hangs the engine: before each message rank 0 checks the processes are alive,
a collective whose peer died fails (gloo sees the closed connection; the process group's timeout
bounds the rest), and the error names the dead rank. The engine core turns any step's error into
a failed core, so /health fails and every request in flight ends with an error. A rank whose
parent (the fork server, which exits with the engine) dies gets SIGTERM, and its pipe's end of
file, so none outlives the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_readable
from pathlib import Path
from typing import Any

import torch

from kvscale.processes import free_port
from kvscale.server.core.block_pool import TierCopies
from kvscale.server.worker import tp_nodes
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.model_runner import ModelRunner
from kvscale.server.worker.sampler import Sampler
from kvscale.server.worker.start_up_passes import StepProfile
from kvscale.server.worker.tp_messages import apply_message, portable

logger = logging.getLogger(__name__)

# How long a collective may wait for its peers before it fails: a backstop for a rank that
# stops without closing its connections; a dead process fails the collective at once.
COLLECTIVE_TIMEOUT_S = 120.0
# How long a rank may take to start: import torch, join the group, read its slices.
START_TIMEOUT_S = 300.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot step any more."""


@dataclass(frozen=True)
class RankSettings:
    """What a rank process is started with (pickled by multiprocessing)."""

    path: str
    rank: int
    size: int
    init_method: str
    dtype: torch.dtype
    device_type: str
    block_size: int
    kv_cache_dtype: torch.dtype
    num_threads: int
    ranks_per_node: int  # a GPU rank's device is its index on its node


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def load_shard(path: Path, hf_config: Any, dtype: torch.dtype, device: torch.device, rank: int,
               size: int) -> Any:
    """Rank ``rank``'s model: the family's decoder over its shard, joined to the other ranks."""
    from kvscale.server.worker import model_llama
    from kvscale.server.worker.model_loader import _materialize, model_spec
    from kvscale.server.worker.tp_layers import join_ranks
    from kvscale.server.worker.tp_shard import ShardPlan, read_shard, vocab_shard

    spec = model_spec(hf_config)
    plan = ShardPlan.for_spec(spec, rank, size)
    shard_spec = plan.shard_spec(spec)
    with torch.device("meta"):
        model = model_llama.DecoderForCausalLM(shard_spec, hf_config)
    _materialize(model, dtype, device)
    model.load_hf_weights(read_shard(path, plan, dtype))
    # Sampling, grammars and prompt checks see the whole vocabulary: the head gathers it.
    model.spec = dataclasses.replace(shard_spec, vocab_size=spec.vocab_size)
    join_ranks(model, spec.vocab_size, vocab_shard(spec.vocab_size, size, rank)[0], size)
    return model.eval()


def run_rank(settings: RankSettings, conn: Any) -> None:
    """A rank process's main: join the group, load the shard, then mirror rank 0's messages."""
    from kvscale.processes import die_with_parent

    die_with_parent()
    torch.set_num_threads(settings.num_threads)
    import torch.distributed as dist

    try:
        dist.init_process_group("nccl" if settings.device_type == "cuda" else "gloo",
                                init_method=settings.init_method, rank=settings.rank,
                                world_size=settings.size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        from kvscale.server.worker.model_config import load_model_config

        device = rank_device(settings.device_type, settings.rank % settings.ranks_per_node)
        model = load_shard(Path(settings.path), load_model_config(settings.path), settings.dtype, device,
                           settings.rank, settings.size)
        runner = ModelRunner(model, settings.block_size, settings.dtype, device,
                             kv_cache_dtype=settings.kv_cache_dtype)
    except BaseException as exc:  # noqa: BLE001 - rank 0 must hear why
        conn.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        raise
    conn.send_bytes(pickle.dumps(("ready",)))
    try:
        _serve(runner, conn)
    except BaseException:  # noqa: BLE001 - say why before the process dies
        logger.error("tensor-parallel rank %d failed:\n%s", settings.rank, traceback.format_exc())
        raise
    dist.destroy_process_group()


def _serve(runner: ModelRunner, conn: Any) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if not apply_message(runner, message):
            return


class RankProcesses:
    """The other ranks: this node's processes (ranks ``first_rank``.. on), the pipes rank 0 sends
    each step down, and the other nodes' connections (tp_nodes.py), which take the same."""

    def __init__(self, processes: list[Any], conns: list[Any], *, first_rank: int = 1,
                 nodes: tp_nodes.NodeLinks | None = None) -> None:
        self.processes = processes
        self.first_rank = first_rank
        self.nodes = nodes
        self.conns = conns + (nodes.conns if nodes else [])
        self.names = [f"rank {first_rank + i}" for i in range(len(conns))] + (nodes.names if nodes else [])
        self.closed = False

    def dead(self, wait_s: float = 0.0) -> str | None:
        """Which ranks have died, and how; None while all live. ``wait_s``: how long a death may
        take to show (a collective fails a moment before its peer's process or connection does)."""
        if peers := [p.sentinel for p in self.processes] + (self.nodes.live() if self.nodes else []):
            wait_readable(peers, wait_s)
        gone = [f"rank {self.first_rank + i} (pid {p.pid}, exit code {p.exitcode})"
                for i, p in enumerate(self.processes) if not p.is_alive()]
        return ", ".join(gone + (self.nodes.gone() if self.nodes else [])) or None

    def collective_failed(self, exc: RuntimeError) -> RankFailed:
        """A collective failed: the error, naming the rank that took it down."""
        return RankFailed(f"tensor-parallel collective failed ({self.dead(1.0) or 'ranks alive'}): {exc}")

    def check(self) -> None:
        dead = self.dead()
        if self.closed or dead:
            raise RankFailed(f"tensor-parallel {dead or 'ranks closed'}: the engine cannot run steps")

    def send(self, message: tuple[Any, ...]) -> None:
        self.send_bytes(pickle.dumps(message))

    def send_bytes(self, data: bytes) -> None:
        self.check()
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            raise RankFailed(f"tensor-parallel rank unreachable ({self.dead() or exc})") from exc

    def wait_ready(self) -> None:
        for name, conn in zip(self.names, self.conns, strict=True):
            if not conn.poll(START_TIMEOUT_S):
                raise RankFailed(f"tensor-parallel {name} did not start in {START_TIMEOUT_S:.0f} s")
            try:
                reply = pickle.loads(conn.recv_bytes(tp_nodes.MAX_REPLY_BYTES))
            except (EOFError, OSError) as exc:
                raise RankFailed(f"tensor-parallel {name} died while starting ({self.dead()})") from exc
            if reply[0] != "ready":
                raise RankFailed(f"tensor-parallel {name} failed to start: {reply[1]}")

    def close(self) -> None:
        """Stop the ranks (they exit on the message or on their pipe's end of file)."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("stop",)))
            conn.close()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


class _MirroredModel:
    """Rank 0's model: each forward pass's inputs go to the other ranks before it runs here."""

    def __init__(self, model: Any, ranks: RankProcesses) -> None:
        self._model = model
        self._ranks = ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        self._ranks.send(("forward", ids.cpu(), positions.cpu(), portable(meta), logits_indices.cpu()))
        return self._guarded(self._model.hidden_states, ids, positions, kv_caches, meta, logits_indices)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._guarded(self._model.compute_logits, hidden)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(ids, positions, kv_caches, meta, logits_indices))

    def _guarded(self, run: Any, *args: Any) -> Any:
        try:
            return run(*args)
        except RuntimeError as exc:
            raise self._ranks.collective_failed(exc) from exc


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: the plain one, whose passes, block copies, cache and host tier also run on
    the others."""

    def __init__(self, model: Any, ranks: RankProcesses, block_size: int, dtype: torch.dtype,
                 device: torch.device, *, kv_cache_dtype: torch.dtype) -> None:
        super().__init__(_MirroredModel(model, ranks), block_size, dtype, device,  # type: ignore[arg-type]
                         kv_cache_dtype=kv_cache_dtype)
        self.ranks = ranks
        self._finalizer = weakref.finalize(self, _close_group, ranks)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int, num_window_blocks: int = 0) -> None:
        # Each rank holds both groups' caches for its own heads; the pools stay here (tp_messages.py).
        self.ranks.send(("alloc", num_blocks, max_model_len, num_window_blocks, self.groups))
        super().allocate_kv_cache(num_blocks, max_model_len, num_window_blocks)

    def allocate_host_cache(self, num_slots: int) -> None:
        self.ranks.send(("host_alloc", num_slots))
        super().allocate_host_cache(num_slots)

    def move_between_tiers(self, copies: TierCopies) -> None:
        if copies:
            self.ranks.send(("tiers", copies))
        super().move_between_tiers(copies)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.ranks.send(("copy", copies))
        super().copy_blocks(copies)

    def copy_window_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.ranks.send(("window_copy", copies))
        super().copy_window_blocks(copies)

    def profile_run(self, lengths: list[int], sampler: Sampler) -> StepProfile:
        # A refusal of the settings (ValueError: the core reports it as invalid), not a failure.
        raise ValueError("tensor parallel cannot size the KV cache by a profiling pass yet (it swaps "
                         "rank 0's cache only): give --num-gpu-blocks-override or --kv-cache-memory-bytes")

    def capture_decode_graphs(self, max_num_seqs: int, capture: Any = None) -> bool:
        logger.info("kvscale engine: decode steps run eagerly with tensor parallel (no CUDA graphs)")
        return False

    def close(self) -> None:
        self._finalizer()


def _close_group(ranks: RankProcesses) -> None:
    import torch.distributed as dist

    ranks.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _start_under_a_daemon(process: Any) -> None:
    """Start ``process`` even from a daemonic process (the engine core is one, so that it dies
    with the front end). multiprocessing refuses that because a daemon's exit does not join its
    children; the ranks need no joining: each exits on its pipe's end of file or when the fork
    server, which exits with the engine, goes."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        process.start()
    finally:
        config["daemon"] = was_daemon


def spawn_ranks(path: Path, ranks: range, size: int, init_method: str, dtype: torch.dtype, device_type: str,
                block_size: int, kv_cache_dtype: torch.dtype, ranks_per_node: int) -> tuple[list[Any], list[Any]]:
    """Start ``ranks`` as processes on this node: the processes and the pipes to them."""
    # A fork server, this module preloaded: it imports torch once per engine process, and every
    # rank forks from it (seconds each under spawn); unlike forking the engine itself, it has
    # no threads (OpenMP's, the engine's) to break in the child.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    processes, conns = [], []
    for rank in ranks:
        parent_end, child_end = ctx.Pipe()
        settings = RankSettings(str(path), rank, size, init_method, dtype, device_type, block_size,
                                kv_cache_dtype, torch.get_num_threads(), ranks_per_node)
        process = ctx.Process(target=run_rank, args=(settings, child_end), name=f"kvscale-tp-rank-{rank}",
                              daemon=True)
        _start_under_a_daemon(process)
        child_end.close()
        processes.append(process)
        conns.append(parent_end)
    return processes, conns


def start_tensor_parallel(path: Path, hf_config: Any, size: int, dtype: torch.dtype, device: torch.device,
                          block_size: int, kv_cache_dtype: torch.dtype,
                          layout: tp_nodes.NodeLayout | None = None) -> tuple[Any, TensorParallelRunner]:
    """Spawn this node's ranks 1.., wait for the other nodes' (``layout``, tp_nodes.py), join them
    as rank 0, load rank 0's shard: its model and runner."""
    import torch.distributed as dist

    from kvscale.server.worker.model_loader import model_spec

    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process")
    layout = layout or tp_nodes.NodeLayout(size, 1, 0, "127.0.0.1", 0)
    nodes, init_method = None, f"tcp://127.0.0.1:{free_port()}"  # one node: a free loopback port
    if layout.nnodes > 1:
        init_method = layout.init_method
        start = tp_nodes.NodeStart(dtype, device.type, block_size, kv_cache_dtype, repr(model_spec(hf_config)))
        nodes = tp_nodes.accept_nodes(layout, start, START_TIMEOUT_S, COLLECTIVE_TIMEOUT_S)
    processes, conns = spawn_ranks(path, layout.node_ranks(0)[1:], size, init_method, dtype, device.type, block_size,
                                   kv_cache_dtype, layout.ranks_per_node)
    ranks = RankProcesses(processes, conns, nodes=nodes)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=0,
                                world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        model = load_shard(path, hf_config, dtype, rank_device(device.type, 0), 0, size)
        ranks.wait_ready()
    except BaseException:
        _close_group(ranks)
        raise
    pids = ",".join(str(pid) for pid in [os.getpid(), *(p.pid for p in processes)])
    logger.info("kvscale engine: tensor parallel over %d ranks (pids %s, %s)%s", size, pids, dist.get_backend(),
                f": ranks {len(processes) + 1}.. on {', '.join(nodes.names)}" if nodes else "")
    return model, TensorParallelRunner(model, ranks, block_size, dtype, rank_device(device.type, 0),
                                       kv_cache_dtype=kv_cache_dtype)
