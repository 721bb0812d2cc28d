"""The LoRA slots' memory, reserved before the KV cache is sized (server/worker/lora_memory.py,
server/worker/kv_sizing.py): the figure is what ``fuse_adapter`` lays out for an adapter of the
largest rank on every projection, and a card it leaves no KV room on is refused with the figures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvscale.server.worker.kv_sizing import GIB, kv_cache_blocks
from kvscale.server.worker.lora_adapter import LoRAAdapter
from kvscale.server.worker.lora_layers import LoRABatch, LoRALinear, Slice, fuse_adapter
from kvscale.server.worker.lora_memory import ProjectionDims, lora_memory

MIB = 1024**2
MODULES = {"q_proj": ("h", "q"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("q", "h"),
           "gate_proj": ("h", "i"), "up_proj": ("h", "i"), "down_proj": ("i", "h")}


def _wrapped(dims: ProjectionDims) -> list[LoRALinear]:
    """The wrapped projections of lora_manager.wrap_projections, around stand-in bases."""
    h, q, kv, i = dims.hidden, dims.q, dims.kv, dims.intermediate
    batch, out = LoRABatch(), []
    for layer in range(dims.num_layers):
        for name, slices, in_features in (
                ("qkv_proj", (Slice("q_proj", 0, q), Slice("k_proj", q, kv), Slice("v_proj", q + kv, kv)), h),
                ("o_proj", (Slice("o_proj", 0, h),), q),
                ("gate_up_proj", (Slice("gate_proj", 0, i), Slice("up_proj", i, i)), h),
                ("down_proj", (Slice("down_proj", 0, h),), i)):
            out.append(LoRALinear(nn.Identity(), (layer, name), slices, in_features, batch))
    return out


def test_the_slots_are_what_fuse_adapter_lays_out_at_the_largest_rank() -> None:
    dims = ProjectionDims(num_layers=2, hidden=8, q=8, kv=4, intermediate=12)
    rank = 3
    width = {"h": dims.hidden, "q": dims.q, "kv": dims.kv, "i": dims.intermediate}
    weights = {(layer, m): (torch.randn(rank, width[a]), torch.randn(width[b], rank))
               for layer in range(dims.num_layers) for m, (a, b) in MODULES.items()}
    adapter = LoRAAdapter("full", "/full", rank, 1.0, weights)
    fused = fuse_adapter(adapter, _wrapped(dims), torch.bfloat16, torch.device("cpu"))
    device = sum(t.numel() * t.element_size() for pair in fused.fused.values() for t in pair)
    host = sum(t.numel() * t.element_size() for pair in weights.values() for t in pair)  # float32, as read
    memory = lora_memory(dims, max_loras=4, max_cpu_loras=6, max_lora_rank=rank, element_bytes=2)
    assert memory.device_bytes == 4 * device
    assert memory.host_bytes == 6 * host


def test_the_slots_come_off_the_kv_cache_and_a_card_without_room_is_refused() -> None:
    dims = ProjectionDims(num_layers=32, hidden=4096, q=4096, kv=1024, intermediate=14336)  # Llama-3-8B's
    slots = lora_memory(dims, max_loras=4, max_cpu_loras=4, max_lora_rank=64, element_bytes=2)
    # 4 slots of rank 64 on every projection; the fused block-diagonal B of q|k|v and gate|up
    # holds their zeros too.
    assert 1.8 < slots.device_bytes / GIB < 1.9
    plain = kv_cache_blocks(80 * GIB, 16 * GIB, 2 * GIB, 0.9, 2 * MIB, block_size=16)
    with_slots = kv_cache_blocks(80 * GIB, 16 * GIB, 2 * GIB, 0.9, 2 * MIB, block_size=16, lora=slots)
    assert with_slots == plain - -(-slots.device_bytes // (2 * MIB))
    # The same card with room for the weights and the step but not the slots as well.
    with pytest.raises(ValueError) as info:
        kv_cache_blocks(20 * GIB, 16 * GIB, GIB, 0.9, 2 * MIB, block_size=16, lora=slots)
    message = str(info.value)
    for figure in ("no room for the KV cache", "4 LoRA slot(s) of rank 64", f"{slots.device_bytes / GIB:.2f} GiB",
                   "--max-loras", "--max-lora-rank"):
        assert figure in message, (figure, message)
    assert kv_cache_blocks(20 * GIB, 16 * GIB, GIB, 0.9, 2 * MIB, block_size=16) > 0  # without the slots it fit
