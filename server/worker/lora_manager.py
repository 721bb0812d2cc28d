"""The engine's LoRA adapters: the ones registered (``--lora-modules``, or loaded at run time), the
ones kept in host memory (``--max-cpu-loras``, least recently used first out), the few resident on
the model's device (``--max-loras`` slots, least recently used first out), and each step's rows
given its adapter's slot for the wrapped projections (docs/server.md, "LoRA adapters").

Every adapter is read (and checked) when it is registered, at start or at run time; an adapter
evicted from host memory is read again from its path when a step needs it. A step needing one that
is not resident lays it out on the device and evicts the least recently used one not in that step.
The scheduler admits at most ``--max-loras`` adapters into a step (server/core/scheduler.py), so
the slots are enough; should a step need more, it holds them all and the pool shrinks back to its
slots at the next step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from kvscale.kernels.lora import lora_rows
from kvscale.server.worker.lora_adapter import LoRAAdapter, load_lora_adapter
from kvscale.server.worker.lora_layers import (
    LoRABatch,
    LoRADeviceAdapter,
    LoRALinear,
    Slice,
    fuse_adapter,
)
from kvscale.server.worker.model_llama import MLP, Attention, DecoderForCausalLM, DecoderLayer

logger = logging.getLogger(__name__)

# Names registered at once, at most (startup's and run time's): the registry is client-grown
# once /v1/load_lora_adapter is on, so it is bounded (docs/server.md, "Loading adapters at run time").
MAX_LORA_NAMES = 256


def lora_model_refusal(model: DecoderForCausalLM) -> str | None:
    """Why LoRA cannot wrap ``model``'s projections; None where it can."""
    if model.spec.moe is not None:
        return "LoRA on mixture-of-experts models is not supported"
    for layer in model.layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            return f"LoRA supports the Llama-family decoder's layers only, not {type(model).__name__}'s"
    return None


def wrap_projections(model: DecoderForCausalLM, batch: LoRABatch) -> list[LoRALinear]:
    """Replace every layer's four projections by LoRA wrappers around them."""
    spec = model.spec
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter, hidden = spec.intermediate_size, spec.hidden_size
    wrapped: list[LoRALinear] = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [
            (attn, "qkv_proj", (Slice("q_proj", 0, q), Slice("k_proj", q, kv), Slice("v_proj", q + kv, kv)), hidden),
            (attn, "o_proj", (Slice("o_proj", 0, hidden),), q),
            (mlp, "gate_up_proj", (Slice("gate_proj", 0, inter), Slice("up_proj", inter, inter)), hidden),
            (mlp, "down_proj", (Slice("down_proj", 0, hidden),), inter),
        ]
        for parent, name, slices, in_features in parts:
            proj = LoRALinear(getattr(parent, name), (i, name), slices, in_features, batch)
            setattr(parent, name, proj)
            wrapped.append(proj)
    return wrapped


class LoRAManager:
    def __init__(self, model: DecoderForCausalLM, modules: dict[str, str], max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device, max_cpu_loras: int | None = None) -> None:
        why = lora_model_refusal(model)
        if why is not None:
            raise ValueError(why)
        if len(modules) > MAX_LORA_NAMES:
            raise ValueError(f"--lora-modules names {len(modules)} adapters; at most {MAX_LORA_NAMES} are registered")
        self.paths = dict(modules)  # name -> PEFT directory
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.wrapped = wrap_projections(model, self.batch)
        self.keys = [proj.key for proj in self.wrapped]
        # A CUDA graph would replay the rows' adapters of its capture (server/worker/decode_graphs.py).
        model.graph_capture_blocker = "LoRA adapters (--enable-lora) group each step's rows by adapter"
        # The one-call C path (server/worker/cpu_step_layers.py) would skip the wrappers: it is
        # looked for anew and finds projections it does not run.
        model._cpu_step_layers_checked = False
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.reads = 0  # adapters read from their paths (at start, and again after a host eviction)
        self.resident: OrderedDict[str, LoRADeviceAdapter] = OrderedDict()  # least recently used first
        for name in self.paths:  # every adapter checked at start: a bad one fails the start, not a request
            self._fused(name)
        self.resident.clear()
        logger.info("kvscale engine: LoRA adapters %s (%d resident at once, %d in host memory, rank up to %d); "
                    "each layer runs module by module (no CUDA graphs, no one-call CPU layers)",
                    ", ".join(self.paths) or "none", max_loras, self.max_cpu_loras, max_lora_rank)

    def add(self, name: str, path: str) -> None:
        """Register ``name`` at ``path``, read and checked as at start; ValueError saying why not."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self.paths) >= MAX_LORA_NAMES:
            raise ValueError(f"{len(self.paths)} LoRA adapters are loaded, the most this server registers "
                             f"({MAX_LORA_NAMES}); unload one first")
        adapter = load_lora_adapter(name, path, self.max_lora_rank)
        self.reads += 1
        fuse_adapter(adapter, self.wrapped, self.dtype, self.device)  # shapes checked against the model
        self.paths[name] = path
        self._keep_on_host(adapter)

    def remove(self, name: str) -> None:
        """Forget ``name`` (the caller checked no request still uses it)."""
        del self.paths[name]
        self._host.pop(name, None)
        self.resident.pop(name, None)
        self.batch.forget()

    def on_host(self, name: str) -> None:
        """``name`` in host memory, read again from its path where it was evicted (ValueError where
        that path no longer holds a valid adapter): a request is refused at admission, not in a step."""
        if name in self.resident:
            return
        adapter = self._host.get(name)
        self._keep_on_host(adapter if adapter is not None else self._read(name))

    def _read(self, name: str) -> LoRAAdapter:
        self.reads += 1
        return load_lora_adapter(name, self.paths[name], self.max_lora_rank)

    def _keep_on_host(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _fused(self, name: str) -> LoRADeviceAdapter:
        """``name`` on the device, loaded (and made most recently used) where it is not."""
        found = self.resident.get(name)
        if found is not None:
            self.resident.move_to_end(name)
            return found
        adapter = self._host.get(name)
        if adapter is None:  # never read, or evicted from host memory: read from its path
            adapter = self._read(name)
        self._keep_on_host(adapter)
        found = self.resident[name] = fuse_adapter(adapter, self.wrapped, self.dtype, self.device)
        return found

    def _make_room(self, needed: set[str]) -> None:
        """Evict least recently used adapters not in ``needed`` down to ``max_loras`` slots."""
        for name in list(self.resident):
            if len(self.resident) <= self.max_loras:
                return
            if name not in needed:
                del self.resident[name]

    def set_step(self, names: Sequence[str | None], num_tokens: Sequence[int]) -> None:
        """Give each adapter of this step a slot and each of its flattened rows that slot:
        sequence i (adapter ``names[i]``, None for the base model) holds the next ``num_tokens[i]`` rows."""
        present = sorted({n for n in names if n is not None})
        if not present:
            self.batch.rows = None
            return
        missing = set(present) - set(self.resident)
        if missing:
            for name in missing:
                self._fused(name)
            self._make_room(set(present))
        for name in present:
            self._fused(name)  # most recently used
        # Every resident adapter holds a slot, in name order, whether this step uses it or not: the
        # slots, and what is laid out by slot (the kernel's tables, kernels/lora_dense.py's stacked
        # matrices), change as adapters are loaded or evicted, not with each step's mix.
        slot_names = sorted(self.resident)
        adapters = tuple(self.resident[name] for name in slot_names)
        slot = {name: i for i, name in enumerate(slot_names)}
        row_slots = np.repeat(np.array([-1 if n is None else slot[n] for n in names], dtype=np.int64),
                              np.asarray(num_tokens, dtype=np.int64))
        self.batch.set_step(adapters, lora_rows(row_slots, self.device), self.keys)
