"""How big the KV cache may be, decided from measured memory figures.

On a GPU the cache takes what is left of ``gpu_memory_utilization`` of the card once the weights
are loaded and the largest step the scheduler can build has been run once and its peak measured
(``ModelRunner.profile_run``): a figure measured on the real model with the real kernels, where
a formula would miss the logits of prompt-logprobs rows, the sampler's copies and each kernel's
workspace. Elsewhere the pool is a fixed budget. Everything here but ``largest_step_profile``
(which runs the pass) is a pure function of the figures; nothing imports torch.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from kvscale.server.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvscale.server.worker.lora_memory import LoRAMemory

if TYPE_CHECKING:
    from kvscale.server.worker.model_runner import ModelRunner, StepProfile
    from kvscale.server.worker.sampler import Sampler

logger = logging.getLogger(__name__)

GIB = 1024**3

# model -> {(sequence lengths, block size, device): what its profiling pass measured}
_STEP_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pass_decides_pool(device_type: str, kv_cache_memory_bytes: int | None,
                      num_gpu_blocks_override: int | None) -> bool:
    """Whether the engine runs the profiling pass: only where its measurement sizes the pool.

    On CPU the budget is a fixed number (``--kv-cache-memory-bytes`` or the default), so the pass
    would only add seconds to every start (and to every test server).
    """
    return device_type == "cuda" and kv_cache_memory_bytes is None and num_gpu_blocks_override is None


def profile_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Token counts of the sequences in the largest step the scheduler can build.

    The whole token budget spread as evenly as possible over as many sequences as a step may
    hold (a token each at least), none longer than ``max_model_len``: every row of such a step
    may need its logits (prompt logprobs), and every sequence a sampling row.
    """
    if min(max_num_batched_tokens, max_num_seqs, max_model_len) < 1:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}), max_num_seqs ({max_num_seqs}) and "
            f"max_model_len ({max_model_len}) must be at least 1"
        )
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    total = min(max_num_batched_tokens, num_seqs * max_model_len)
    base, extra = divmod(total, num_seqs)
    return [base + 1] * extra + [base] * (num_seqs - extra)


def kv_cache_blocks(
    total_bytes: int,
    used_bytes: int,
    peak_bytes: int,
    gpu_memory_utilization: float,
    block_bytes: int,
    *,
    block_size: int,
    max_model_len: int | None = None,
    lora: LoRAMemory | None = None,
) -> int:
    """KV blocks that fit in ``gpu_memory_utilization`` of the device.

    ``used_bytes`` is what the device holds before the profiling pass (weights, CUDA context,
    anything else on the card), ``peak_bytes`` what the pass added at its peak, ``lora`` the
    LoRA slots, filled only later (server/worker/lora_memory.py). With ``max_model_len`` given
    (the user asked for it), one sequence of that length must fit; otherwise the caller caps the
    length at what the pool holds.
    """
    if block_bytes < 1 or block_size < 1:
        raise ValueError(f"block_bytes ({block_bytes}) and block_size ({block_size}) must be positive")
    allowed = int(total_bytes * gpu_memory_utilization)
    lora_bytes = lora.device_bytes if lora is not None else 0
    budget = allowed - used_bytes - peak_bytes - lora_bytes
    num_blocks = max(budget, 0) // block_bytes
    slots = f", {lora.describe()}" if lora is not None else ""
    figures = (
        f"{gpu_memory_utilization:g} of {_gib(total_bytes)} GiB is {_gib(allowed)} GiB; "
        f"{_gib(used_bytes)} GiB was in use after loading the weights and the largest step "
        f"peaked at {_gib(peak_bytes)} GiB more{slots}, leaving {_gib(budget)} GiB for the KV cache"
    )
    if num_blocks < 1:
        knobs = ("--max-num-batched-tokens, --max-num-seqs, --max-loras or --max-lora-rank" if lora_bytes
                 else "--max-num-batched-tokens or --max-num-seqs")
        raise ValueError(
            f"no room for the KV cache: {figures}, less than one block ({block_bytes} bytes). "
            f"Increase --gpu-memory-utilization, or decrease {knobs}"
        )
    if max_model_len is not None and num_blocks * block_size < max_model_len:
        needed = -(-max_model_len // block_size)
        raise ValueError(
            f"one sequence of max_model_len {max_model_len} tokens needs {needed} KV blocks "
            f"({_gib(needed * block_bytes)} GiB) but only {num_blocks} fit: {figures}. "
            f"Increase --gpu-memory-utilization or decrease --max-model-len "
            f"(at most {num_blocks * block_size} fits)"
        )
    return num_blocks


def pool_blocks(
    config: EngineConfig, block_bytes: int, used: int, total: int, step_profile: StepProfile | None,
    lora: LoRAMemory | None = None,
) -> int:
    """The KV pool's size in blocks: the override, else what the profiling pass leaves room for
    (``step_profile``, with the device's ``used`` and ``total`` bytes, less the LoRA slots), else
    the fixed budget (the KV cache's own size, as vLLM's --kv-cache-memory-bytes)."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if step_profile is not None:
        # CUDA always has a meter, so the pass always has a peak.
        assert step_profile.peak_bytes is not None
        return kv_cache_blocks(
            total, used, step_profile.peak_bytes, config.gpu_memory_utilization, block_bytes,
            block_size=config.block_size, max_model_len=config.max_model_len, lora=lora,
        )
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is smaller than one block ({block_bytes} bytes)"
        )
    return int(num_blocks)


def largest_step_profile(
    runner: ModelRunner, sampler: Sampler, config: EngineConfig, max_model_len: int
) -> StepProfile:
    """Run (or recall) the profiling pass for the largest step this engine can schedule."""
    lengths = profile_shape(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    # The same shape on the same weights peaks the same: engines sharing a process's weights
    # (tests, several LLM objects) measure it once.
    key = (tuple(lengths), config.block_size, str(runner.device))
    known = _STEP_PROFILES.setdefault(runner.model, {})
    profile = known.get(key)
    reused = profile is not None
    if profile is None:
        profile = known[key] = runner.profile_run(lengths, sampler)
    peak = "not measurable here" if profile.peak_bytes is None else f"+{profile.peak_bytes / 2**20:.1f} MiB"
    logger.info(
        "profiling pass: %d tokens in %d sequences, peak %s%s", profile.num_tokens, profile.num_seqs,
        peak, " (measured earlier in this process)" if reused else f" in {profile.seconds:.1f} s",
    )
    return profile


def smallest_kv_bytes(config: EngineConfig, block_bytes: int) -> int:
    """The least KV cache a device must hold besides the weights: the pool asked for
    (``--num-gpu-blocks-override``, ``--kv-cache-memory-bytes``), else one sequence of the
    ``--max-model-len`` asked for, else one block (the length is then capped at what fits)."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override * block_bytes
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    return -(-(config.max_model_len or 1) // config.block_size) * block_bytes


def weights_fit_refusal(weight_bytes: int, ranks: int, kv_bytes: int, used_bytes: int, total_bytes: int,
                        gpu_memory_utilization: float) -> str | None:
    """Why a checkpoint cannot be served on these devices, said before any weight is read; None
    where it may fit. Each device holds at least its share of ``weight_bytes`` (the tensors'
    sizes in the dtype they load as, over ``ranks``: replicated norms and KV heads only add) and
    ``kv_bytes`` of KV cache, within ``gpu_memory_utilization`` of its ``total_bytes`` less the
    ``used_bytes`` something else already holds."""
    per_device = -(-weight_bytes // ranks)
    room = int(total_bytes * gpu_memory_utilization) - used_bytes
    if per_device + kv_bytes <= room:
        return None
    share = f" ({_gib(weight_bytes)} GiB over {ranks} devices)" if ranks > 1 else ""
    return (f"the model does not fit: its weights need at least {_gib(per_device)} GiB a device{share} and the "
            f"smallest KV cache {_gib(kv_bytes)} GiB more, but {gpu_memory_utilization:g} of the device's "
            f"{_gib(total_bytes)} GiB less the {_gib(used_bytes)} GiB already in use leaves {_gib(room)} GiB. "
            f"Increase --tensor-parallel-size or --gpu-memory-utilization, or decrease --max-model-len "
            f"(or the KV pool asked for), or load a smaller --dtype")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f}"


# --- the second KV tier (host memory) ---------------------------------------------------------
def host_tier_blocks(
    size_gib: float, block_bytes: int, *, host_room_bytes: int, host_room_what: str, other_host_bytes: int = 0,
    ranks: int = 1, ranks_here: int = 1,
) -> int:
    """Blocks of the host tier for ``--kv-offloading-size`` GiB, or a ValueError saying why it
    does not fit. Under tensor parallel the size is the total over the ``ranks`` (vLLM's
    meaning), each holding its share in slots of its own heads (``block_bytes``: one rank's
    block); ``ranks_here`` of them hold theirs in this machine's memory. Those, plus
    ``other_host_bytes`` (the KV caches, when they too live in host memory), must fit in
    ``host_room_bytes`` (what the machine or the pod's cgroup leaves)."""
    if size_gib <= 0:
        return 0
    if block_bytes < 1 or ranks < 1 or not 1 <= ranks_here <= ranks:
        raise ValueError(f"block_bytes, ranks and ranks_here must be positive (ranks_here at most ranks), got "
                         f"{block_bytes}, {ranks}, {ranks_here}")
    wanted = int(size_gib * GIB) // ranks
    num_blocks = wanted // block_bytes
    over = f" over {ranks} tensor-parallel ranks" if ranks > 1 else ""
    if num_blocks < 1:
        raise ValueError(
            f"--kv-offloading-size {size_gib:g} GiB{over} is smaller than one KV block "
            f"({block_bytes} bytes{' a rank' if ranks > 1 else ''})"
        )
    needed = ranks_here * num_blocks * block_bytes + other_host_bytes
    if needed > host_room_bytes:
        also = f" plus the {_gib(other_host_bytes)} GiB KV cache in host memory" if other_host_bytes else ""
        here = f" ({ranks_here} of its {ranks} ranks' shares on this machine)" if ranks > 1 else ""
        raise ValueError(
            f"--kv-offloading-size {size_gib:g} GiB{here}{also} needs {_gib(needed)} GiB of host memory but "
            f"only {_gib(host_room_bytes)} GiB is available ({host_room_what}). "
            f"Decrease --kv-offloading-size (or the KV cache), or give the pod more memory"
        )
    return int(num_blocks)


# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number.
_CGROUP_V1_UNLIMITED = 2**62


def cgroup_memory(cgroup: str = "/sys/fs/cgroup") -> tuple[int, int, str] | None:
    """(limit, working set, limit file) of this process's memory cgroup, or None without a limit:
    cgroup v2 (memory.max) where mounted, else v1 (memory/memory.limit_in_bytes, still what many
    Kubernetes nodes run). The working set is the usage less inactive file pages, as the kubelet
    counts it: the checkpoint's page cache is reclaimed before anything is OOM-killed."""
    for limit_file, usage_file, stat_file, inactive_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            with open(f"{cgroup}/{limit_file}") as f:
                limit_text = f.read().strip()
            with open(f"{cgroup}/{usage_file}") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= _CGROUP_V1_UNLIMITED:
            return None
        inactive = 0
        try:
            with open(f"{cgroup}/{stat_file}") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return int(limit_text), max(usage - inactive, 0), limit_file
    return None


def host_memory_room(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """Bytes of host memory a new allocation may take, and where the figure comes from: the
    machine's MemAvailable, or less when this process's cgroup limit leaves less."""
    available = 0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    room, what = available, f"MemAvailable of the machine, {_gib(available)} GiB"
    limited = cgroup_memory(cgroup)
    if limited is not None:
        limit, usage, limit_file = limited
        if limit - usage < room:
            room = max(limit - usage, 0)
            what = f"the cgroup's {limit_file} {_gib(limit)} GiB less its {_gib(usage)} GiB working set"
    return room, what
