"""Tensor parallel from an InferenceService's GPUs (docs/operator.md, "Several GPUs per replica").

A replica asking for N > 1 GPUs runs `kvscale serve --tensor-parallel-size N`: one rank per GPU,
as KServe and vLLM's own manifests do. engine.extraArgs may set the flag too, but on GPUs only to
N (a rank per GPU: fewer ranks leave GPUs idle, more share one). On CPU (gpus 0) the ranks are
processes over gloo, and the flag in extraArgs is the only source of the size.

What the operator can check without the weights is checked here, and a spec that fails it gets
nothing applied (Synced=False, as for the allow-lists): the flag against the GPUs; for the
bundled model, whose shape the operator knows, that the size divides what the engine splits
(server/worker/tp_shard.py refuses the same at start for hub and pvc models, naming the heads);
and on GPUs the KV pool's size given, which the engine cannot measure across ranks yet. The CRD
refuses the bundled model on too many GPUs at apply already (a CEL rule with the same numbers);
checked here too for what the rule cannot see (a CPU server's flag) and CRDs older than it.

A replica over several nodes (engine.nodes M > 1, docs/operator.md "A replica over several
nodes") runs M x G ranks, G = resources.gpus in each of its M pods: every rule above holds for
M x G, and the flags placing the ranks on nodes are the operator's own (MULTI_NODE_FLAGS).
"""

from __future__ import annotations

from kvscale.operator.conditions import SYNCED, Condition
from kvscale.operator.spec import EngineConfig, InferenceServiceSpec

TP_FLAG = "--tensor-parallel-size"
TP_SHORT_FLAG = "-tp"
TENSOR_PARALLEL_MISMATCH = "TensorParallelMismatch"
TENSOR_PARALLEL_UNSUPPORTED = "TensorParallelUnsupported"
# The bundled model's shape (SmolLM2-135M-Instruct's config.json): the engine splits its query
# heads and MLP over the ranks, and replicates KV heads where a rank's share needs it.
BUNDLED_NUM_HEADS = 9
BUNDLED_NUM_KV_HEADS = 3
BUNDLED_INTERMEDIATE_SIZE = 1536
# What sizes a tensor-parallel GPU server's KV pool: it cannot measure it with a profiling pass
# (server/worker/tp_group.py), so without one of these it refuses to start.
KV_POOL_FLAGS = ("--kv-cache-memory-bytes", "--num-gpu-blocks-override")
# Shared memory per rank (/dev/shm, memory-backed): torch.multiprocessing and NCCL's intra-node
# transport put their buffers there, and the container runtime's default is 64 MiB.
SHM_GIB_PER_RANK = 1
# The engine's flags placing one replica's ranks on several nodes (server/, `kvscale serve`): the
# operator sets them from engine.nodes (children/leader_worker_set.py), so extraArgs and the
# platform's defaults may not.
MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless")


def replica_gpus(spec: InferenceServiceSpec) -> int:
    """The GPUs of one replica, over all of its nodes: resources.gpus x engine.nodes."""
    return spec.resources.gpus * spec.engine.nodes


def requested_size(engine: EngineConfig) -> str | None:
    """The value engine.extraArgs give --tensor-parallel-size (or -tp), as argparse reads it:
    ``--flag N`` or ``--flag=N``, the last one winning; None when they do not set it."""
    value = None
    args = engine.extra_args
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if name in (TP_FLAG, TP_SHORT_FLAG):
            if eq:
                value = given
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def tensor_parallel_size(spec: InferenceServiceSpec) -> int:
    """The ranks each replica runs: its GPUs (on all its nodes) when more than one, else what
    extraArgs ask (a CPU server's gloo ranks), else 1. Only meaningful for a spec ``refusal``
    lets through."""
    if replica_gpus(spec) > 1:
        return replica_gpus(spec)
    requested = requested_size(spec.engine)
    return int(requested) if requested is not None and requested.isdigit() else 1


def tensor_parallel_args(spec: InferenceServiceSpec) -> list[str]:
    """--tensor-parallel-size N for a replica with N > 1 GPUs (over all its nodes), unless
    extraArgs set it (to N)."""
    if replica_gpus(spec) > 1 and requested_size(spec.engine) is None:
        return [TP_FLAG, str(replica_gpus(spec))]
    return []


def shm_size_limit(spec: InferenceServiceSpec) -> str:
    """/dev/shm's size limit: one rank's share per rank of the pod (resources.gpus of them in
    each pod of a replica over several nodes). A memory-backed emptyDir counts against the
    container's memory limit as it fills; the limit bounds it, reserving nothing."""
    ranks = spec.resources.gpus if spec.engine.nodes > 1 else tensor_parallel_size(spec)
    return f"{SHM_GIB_PER_RANK * max(1, ranks)}Gi"


def refusal(spec: InferenceServiceSpec) -> Condition | None:
    """Synced=False with why, for tensor parallel settings the servers could not start with;
    None when they can (or the operator cannot tell without the weights)."""
    gpus, nodes = replica_gpus(spec), spec.engine.nodes
    per_replica = "resources.gpus" if nodes == 1 else "resources.gpus x engine.nodes"
    over = "" if nodes == 1 else f" ({nodes} nodes of {spec.resources.gpus})"
    placing = [flag for flag in MULTI_NODE_FLAGS if spec.engine.sets(flag)]
    if placing:
        return Condition(SYNCED, False, TENSOR_PARALLEL_MISMATCH,
                         f"engine.extraArgs set {', '.join(placing)}: the operator places a "
                         "replica's ranks on nodes itself, from engine.nodes; nothing is applied")
    requested = requested_size(spec.engine)
    if requested is not None and (not requested.isdigit() or int(requested) < 1):
        return Condition(SYNCED, False, TENSOR_PARALLEL_MISMATCH,
                         f"engine.extraArgs set {TP_FLAG} to {requested!r}, not a positive "
                         "integer: nothing is applied")
    if requested is not None and gpus > 0 and int(requested) != gpus:
        return Condition(SYNCED, False, TENSOR_PARALLEL_MISMATCH,
                         f"engine.extraArgs set {TP_FLAG} {requested} but {per_replica} is "
                         f"{gpus}: each replica runs one rank per GPU, so the two must be equal "
                         f"(or drop the flag: the operator sets {TP_FLAG} {gpus} itself when "
                         "gpus > 1); nothing is applied")
    size = tensor_parallel_size(spec)
    why = bundled_refusal(size) if spec.model.scheme == "bundled" and size > 1 else None
    if why is not None:
        return Condition(SYNCED, False, TENSOR_PARALLEL_UNSUPPORTED,
                         f"{spec.model.uri} cannot run on {size} tensor-parallel ranks: {why}; "
                         "nothing is applied")
    if gpus > 1 and not any(spec.engine.sets(flag) for flag in KV_POOL_FLAGS):
        return Condition(SYNCED, False, TENSOR_PARALLEL_UNSUPPORTED,
                         f"{gpus} GPUs per replica{over} run {size} tensor-parallel ranks, whose KV cache "
                         "the engine cannot size by its profiling pass yet (docs/engine.md, "
                         f"\"Tensor parallel\"): set {' or '.join(KV_POOL_FLAGS)} in "
                         "engine.extraArgs; nothing is applied")
    return None


def bundled_refusal(size: int) -> str | None:
    """Why the bundled model cannot be split over ``size`` ranks, in the engine's terms; None
    if it can."""
    if BUNDLED_NUM_HEADS % size:
        return f"{size} does not divide its {BUNDLED_NUM_HEADS} attention heads"
    if BUNDLED_INTERMEDIATE_SIZE % size:
        return f"{size} does not divide its MLP's intermediate size {BUNDLED_INTERMEDIATE_SIZE}"
    return None
