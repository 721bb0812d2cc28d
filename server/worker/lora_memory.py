"""The memory LoRA adapters take, reserved before the KV cache is sized (docs/server.md, "LoRA
adapters"): ``--max-loras`` device slots, each an adapter of ``--max-lora-rank`` on every wrapped
projection as ``lora_layers.fuse_adapter`` lays it out, and the ``--max-cpu-loras`` host pool of
adapters as read from their files. Pure arithmetic on the model's shapes; nothing imports torch.

The slots are filled on demand, after the KV cache took its share of the card, so without the
reservation a full device would fail the first step that loads an adapter instead of the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1024**3
# Host copies keep the file's dtype: PEFT saves float32 unless told otherwise, the largest.
HOST_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class ProjectionDims:
    """The wrapped projections' widths (server/worker/lora_manager.py, ``wrap_projections``)."""

    num_layers: int
    hidden: int
    q: int  # num_heads * head_dim
    kv: int  # num_kv_heads * head_dim
    intermediate: int

    @classmethod
    def of(cls, spec: Any) -> ProjectionDims:
        return cls(spec.num_layers, spec.hidden_size, spec.num_heads * spec.head_dim,
                   spec.num_kv_heads * spec.head_dim, spec.intermediate_size)


def fused_adapter_elements(dims: ProjectionDims, rank: int) -> int:
    """Elements of one adapter of ``rank`` targeting every projection, fused for the device: per
    fused projection A [slices * r, in] and a block-diagonal B [out, slices * r]."""
    h, q, kv, inter = dims.hidden, dims.q, dims.kv, dims.intermediate
    per_layer = (3 * h + (q + 2 * kv) * 3  # q|k|v from hidden
                 + q + h  # o
                 + 2 * h + 2 * inter * 2  # gate|up from hidden
                 + inter + h)  # down
    return dims.num_layers * rank * per_layer


def host_adapter_elements(dims: ProjectionDims, rank: int) -> int:
    """Elements of one such adapter as read from its file: A [r, in] and B [out, r] per module."""
    h, q, kv, inter = dims.hidden, dims.q, dims.kv, dims.intermediate
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    return dims.num_layers * rank * per_layer


@dataclass(frozen=True)
class LoRAMemory:
    device_bytes: int  # the --max-loras slots on the model's device
    host_bytes: int  # the --max-cpu-loras pool in host memory
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int

    def describe(self) -> str:
        return (f"{self.max_loras} LoRA slot(s) of rank {self.max_lora_rank} (--max-loras, --max-lora-rank) "
                f"take {self.device_bytes / GIB:.2f} GiB")


def lora_memory(dims: ProjectionDims, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                element_bytes: int) -> LoRAMemory:
    """What the slots (at the model's ``element_bytes``) and the host pool take at most."""
    return LoRAMemory(
        device_bytes=max_loras * fused_adapter_elements(dims, max_lora_rank) * element_bytes,
        host_bytes=max_cpu_loras * host_adapter_elements(dims, max_lora_rank) * HOST_ELEMENT_BYTES,
        max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank)
