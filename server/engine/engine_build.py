"""An engine's parts built from its config: the model loaded, the KV pool sized from measured
memory and allocated, the scheduler over it, the sampler, the decode graphs captured.

Construction is its own step so the step loop (llm_engine.py) holds only what runs per step. The
order matters: a KV cache dtype the backend cannot read is refused before the weights load; the
pool is sized after the weights (and on a GPU the RoPE tables) hold their memory and, where a
forward pass decides the pool, after the largest step has been profiled (kv_sizing.py); the host
tier is checked against the machine before anything is allocated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvscale.model_files import load_tokenizer, resolve_model_path, served_model_name
from kvscale.server.config import EngineConfig
from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.host_tier import HostTier
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.scheduler import Scheduler
from kvscale.server.core.window_group import WindowGroup
from kvscale.server.structured_outputs.manager import StructuredOutputManager
from kvscale.server.worker.kv_cache_dtype import kv_cache_dtype_name, resolve_kv_cache_dtype
from kvscale.server.worker.kv_groups import (
    KVGroups,
    group_block_bytes,
    group_pool_blocks,
    kv_groups,
)
from kvscale.server.worker.kv_sizing import (
    host_memory_room,
    host_tier_blocks,
    largest_step_profile,
    pass_decides_pool,
    pool_blocks,
    smallest_kv_bytes,
    weights_fit_refusal,
)
from kvscale.server.worker.lora_memory import ProjectionDims, lora_memory
from kvscale.server.worker.memory_profile import device_memory
from kvscale.server.worker.model_config import load_model_config
from kvscale.server.worker.model_loader import (
    eos_token_ids,
    load_model,
    resolve_device,
    resolve_dtype,
)
from kvscale.server.worker.model_runner import ModelRunner, StepProfile, kv_block_bytes
from kvscale.server.worker.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an LLMEngine steps: each part built once, in the order the module docstring gives."""

    model_path: Path
    model_name: str
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    model: Any
    eos_token_ids: set[int]
    sampler: Sampler
    runner: ModelRunner
    step_profile: StepProfile | None
    num_blocks: int
    kv_cache_bytes: int
    # A sequence may never need more than the whole pool (so preemption always makes progress).
    max_model_len: int
    num_host_blocks: int
    pool: BlockPool
    kv: KVCacheManager
    scheduler: Scheduler
    structured: StructuredOutputManager


def supported_max_len(config: EngineConfig, spec: Any) -> int:
    """The longest sequence asked for: ``--max-model-len``, or the model's own limit."""
    model_max_len = spec.max_position_embeddings
    if spec.sliding_window:
        # Attention here is always full; beyond the window the model would differ.
        model_max_len = min(model_max_len, spec.sliding_window)
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds what the model supports ({model_max_len})"
        )
    return config.max_model_len or model_max_len


def _start_ranks(config: EngineConfig, path: Path, model_config: Any, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: torch.dtype) -> tuple[Any, ModelRunner]:
    """Tensor parallel: refuse what it does not support yet, then start the ranks."""
    from kvscale.server.worker.model_loader import model_spec
    from kvscale.server.worker.tp_group import start_tensor_parallel
    from kvscale.server.worker.tp_nodes import NodeLayout
    from kvscale.server.worker.tp_shard import tensor_parallel_refusal

    why = tensor_parallel_refusal(config.tensor_parallel_size, getattr(model_config, "model_type", None),
                                  model_spec(model_config), quantization=config.quantization)
    if why is not None:
        raise ValueError(why)
    layout = NodeLayout(config.tensor_parallel_size, config.nnodes, config.node_rank, config.master_addr,
                        config.master_port)
    return start_tensor_parallel(path, model_config, config.tensor_parallel_size, dtype, device,
                                 config.block_size, kv_cache_dtype, layout)


def checkpoint_fit_refusal(config: EngineConfig, path: Path, model_config: Any, dtype: torch.dtype,
                           kv_cache_dtype: torch.dtype, used: int, total: int) -> str | None:
    """Why devices of ``total`` bytes, ``used`` of them taken, cannot hold this checkpoint with the
    smallest KV cache, said before a weight is read (loading it would end in an out-of-memory
    error part way); None where it may fit."""
    from kvscale.server.worker.model_loader import checkpoint_elements, model_spec

    elements = checkpoint_elements(path)
    if elements is None:
        return None
    spec, ranks = model_spec(model_config), config.tensor_parallel_size
    block_bytes = kv_block_bytes(spec.num_layers, config.block_size, -(-spec.num_kv_heads // ranks), spec.head_dim,
                                 kv_cache_dtype)
    return weights_fit_refusal(elements * dtype.itemsize, ranks, smallest_kv_bytes(config, block_bytes), used, total,
                               config.gpu_memory_utilization)


def window_group_of(config: EngineConfig, spec: Any) -> KVGroups | None:
    """The sliding-window layers' KV group (kv_groups.py), or None: one group keeps every block,
    also where the window group is not built yet (docs/engine.md, "Sliding-window layers' KV blocks")."""
    groups = kv_groups(getattr(spec, "layer_windows", ()))
    if groups is not None and config.kv_offloading_size:
        logger.info("kvscale engine: --kv-offloading-size %g: the sliding-window layers keep every KV block "
                    "(their own group runs without a host tier)", config.kv_offloading_size)
        return None
    return groups


def build_engine(config: EngineConfig) -> EngineParts:
    torch.manual_seed(config.seed)
    path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(path)
    model_config = load_model_config(path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    # Before the weights load: a cache dtype this backend cannot read is refused at once.
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    runner: ModelRunner | None = None
    if device.type == "cuda":
        why = checkpoint_fit_refusal(config, path, model_config, dtype, kv_cache_dtype, *device_memory(device))
        if why is not None:
            raise ValueError(why)
    if config.tensor_parallel_size > 1:
        model, runner = _start_ranks(config, path, model_config, dtype, device, kv_cache_dtype)
    else:
        model = load_model(path, model_config, dtype, device, config.quantization, shared=not config.enable_lora)
    lora = None
    if config.enable_lora:
        from kvscale.server.worker.lora_manager import LoRAManager

        lora = LoRAManager(model, config.lora_modules, config.max_loras, config.max_lora_rank, dtype, device,
                           config.max_cpu_loras)
    spec = model.spec
    wanted_len = supported_max_len(config, spec)

    block_bytes = kv_block_bytes(spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim,
                                 kv_cache_dtype)
    eos_ids = eos_token_ids(tokenizer, path)
    sampler = Sampler(eos_ids, lambda token_id: tokenizer.decode([token_id]), seed=config.seed)
    if runner is None:
        runner = ModelRunner(model, config.block_size, dtype, device, kv_cache_dtype=kv_cache_dtype)
    runner.lora = lora
    groups = runner.groups = window_group_of(config, spec)
    used = total = 0
    if device.type == "cuda":
        # RoPE tables for the longest possible sequence first: they stay for the engine's
        # life, so they count as used, like the weights (and whatever else holds the card).
        model.build_rope_cache(wanted_len)
        used, total = device_memory(device)
    step_profile: StepProfile | None = None
    if pass_decides_pool(device.type, config.kv_cache_memory_bytes, config.num_gpu_blocks_override):
        step_profile = largest_step_profile(runner, sampler, config, wanted_len)
    # The LoRA slots are filled on demand, after the KV cache took the card: reserved first.
    slots = lora_memory(ProjectionDims.of(spec), lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank,
                        dtype.itemsize) if lora is not None else None
    num_blocks = pool_blocks(config, block_bytes, used, total, step_profile, slots)
    kv_cache_bytes = num_blocks * block_bytes
    num_window_blocks = 0
    if groups is not None:
        per_layer = block_bytes // spec.num_layers
        num_blocks, num_window_blocks = group_pool_blocks(
            groups, num_blocks, per_layer, overridden=config.num_gpu_blocks_override is not None,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size)
        block_bytes, window_block_bytes = group_block_bytes(groups, per_layer)
        kv_cache_bytes = num_blocks * block_bytes + num_window_blocks * window_block_bytes
    max_model_len = min(wanted_len, num_blocks * config.block_size)

    # The host tier (--kv-offloading-size): checked against the machine before anything is
    # allocated; on CPU the KV cache itself is host memory too, as are the LoRA slots and pool, and
    # the slots once more: the CPU path's copy of them stacked (kernels/lora_dense.py).
    room, room_what = host_memory_room()
    host_lora = (slots.host_bytes + (2 * slots.device_bytes if device.type == "cpu" else 0)) if slots else 0
    # Under tensor parallel ``block_bytes`` is one rank's (its heads'), and the size the total
    # over the ranks, as vLLM's; each of this node's ranks holds a KV cache and a share of it
    # (docs/engine.md, "Tensor parallel").
    ranks_here = config.tensor_parallel_size // config.nnodes
    num_host_blocks = host_tier_blocks(
        config.kv_offloading_size, block_bytes, host_room_bytes=room, host_room_what=room_what,
        other_host_bytes=(ranks_here * kv_cache_bytes if device.type == "cpu" else 0) + host_lora,
        ranks=config.tensor_parallel_size, ranks_here=ranks_here,
    ) if config.enable_prefix_caching else 0
    host = HostTier(num_host_blocks) if num_host_blocks else None
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching, host)
    window = (WindowGroup(BlockPool(num_window_blocks, config.block_size, config.enable_prefix_caching), groups.window)
              if groups is not None else None)
    kv = KVCacheManager(pool, config.enable_prefix_caching, window)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                          config.max_loras if config.enable_lora else 0, config.scheduling_policy)
    scheduler.block_bytes = block_bytes
    runner.allocate_kv_cache(num_blocks, max_model_len, num_window_blocks)
    if device.type == "cuda" and not config.enforce_eager:
        started = time.perf_counter()
        if runner.capture_decode_graphs(config.max_num_seqs):
            logger.info("kvscale engine: captured decode CUDA graphs for batch sizes up to %d in %.1f s "
                        "(--enforce-eager turns them off)", config.max_num_seqs, time.perf_counter() - started)
    if num_host_blocks:
        runner.allocate_host_cache(num_host_blocks)
    structured = StructuredOutputManager(tokenizer, spec.vocab_size, eos_ids,
                                         config.structured_outputs_config)
    model_name = served_model_name(config.model, config.served_model_name)
    logger.info(
        "kvscale engine: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB, KV cache dtype %s), max_model_len %d",
        model_name, device, dtype, num_blocks, config.block_size, kv_cache_bytes / 2**20,
        kv_cache_dtype_name(kv_cache_dtype), max_model_len,
    )
    return EngineParts(
        model_path=path, model_name=model_name,
        tokenizer=tokenizer, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, model=model,
        eos_token_ids=eos_ids, sampler=sampler, runner=runner, step_profile=step_profile,
        num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
        num_host_blocks=num_host_blocks, pool=pool, kv=kv, scheduler=scheduler, structured=structured,
    )
