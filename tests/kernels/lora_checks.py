"""Random batched-LoRA cases and the comparison of the Triton kernel (kernels/lora_triton.py) with
its PyTorch reference (kernels/lora.py's ``torch_add_lora``).

Shared, through kernel_checks.py's "lora" kernel, by the interpreter test, the CUDA test and
``bench/gpu_kernels.py --check``; ``bench/gpu_kernels_lora.py`` times the same cases' shapes.

A case's step has an odd number of rows: base rows (slot -1) mixed with slots of rank 8 and 16, one
of them over several tiles, and a slot whose adapter leaves the projection alone; or now and then
one slot holding every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvscale.kernels.lora import TILE_ROWS, LoRARows, LoRASlots, lora_rows, torch_add_lora

# Relative to 1 + |expected|: the two sum in different orders, and bfloat16 rounds h before B.
LORA_TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@dataclass
class LoRACase:
    x: Tensor  # [rows, in]
    out: Tensor  # [rows, out]: the base projection's output the deltas are added to
    row_slots: list[int]
    pairs: list[tuple[Tensor, Tensor] | None]  # per slot: A [slices * rank, in], B [out, slices * rank]
    ranks: list[int]
    # Where B is block-diagonal by slices (a fused projection's), their (first column, width).
    slices: tuple[tuple[int, int], ...] = ()

    def on(self, device: str | torch.device) -> tuple[Tensor, Tensor, LoRARows, LoRASlots]:
        """The case's tensors on ``device`` (out a fresh copy), as the projections pass them."""
        pairs = tuple(None if p is None else (p[0].to(device), p[1].to(device)) for p in self.pairs)
        return (self.x.to(device), self.out.clone().to(device), lora_rows(self.row_slots, torch.device(device)),
                LoRASlots(pairs, self.slices))

    def per_row(self) -> Tensor:
        """The contract row by row in float64: ``out`` plus each row's own slot's delta."""
        expected = self.out.double().clone()
        for i, s in enumerate(self.row_slots):
            pair = self.pairs[s] if s >= 0 else None
            if pair is not None:
                expected[i] += pair[1].double() @ (pair[0].double() @ self.x[i].double())
        return expected


def make_lora_case(gen: torch.Generator, dtype: torch.dtype, *, rows: int, in_features: int,
                   slice_width: int, slices: int, ranks: list[int | None], base_share: float,
                   one_slot: bool = False, first_slots: tuple[int, ...] = (),
                   fused: tuple[int, ...] = ()) -> LoRACase:
    """Slot i of rank ``ranks[i]`` (None: its adapter does not target this projection); the rows'
    slots drawn (``base_share`` of them base rows) but for the ``first_slots`` given. ``fused``:
    the widths of a fused projection's slices (``slices`` and ``slice_width`` then unused), each
    slot's B block-diagonal by them as lora_layers.fuse_adapter lays it out."""
    if fused:
        slices, out_features = len(fused), sum(fused)
        firsts = [sum(fused[:j]) for j in range(len(fused))]
    else:
        out_features = slices * slice_width
    pairs: list[tuple[Tensor, Tensor] | None] = []
    for rank in ranks:
        if rank is None:
            pairs.append(None)
            continue
        k = slices * rank
        a = torch.randn(k, in_features, generator=gen) * in_features**-0.5
        b = torch.randn(out_features, k, generator=gen) * k**-0.5
        if fused:
            block = torch.zeros_like(b)
            for j, (first, width) in enumerate(zip(firsts, fused, strict=True)):
                block[first:first + width, j * rank:(j + 1) * rank] = b[first:first + width, j * rank:(j + 1) * rank]
            b = block
        pairs.append((a.to(dtype), b.to(dtype)))
    if one_slot:
        row_slots = [0] * rows
    else:
        draws = torch.randint(len(ranks), (rows,), generator=gen).tolist()
        base = (torch.rand(rows, generator=gen) < base_share).tolist()
        row_slots = [-1 if is_base else s for s, is_base in zip(draws, base, strict=True)]
        row_slots[: len(first_slots)] = first_slots
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, out_features, generator=gen).to(dtype)
    layout = tuple(zip(firsts, fused, strict=True)) if fused else ()
    return LoRACase(x, out, row_slots, pairs, [r or 0 for r in ranks], layout)


def random_lora_case(gen: torch.Generator, dtype: torch.dtype) -> LoRACase:
    def pick(options: list) -> int:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    one_slot = bool(pick([0, 0, 1]))
    rows = pick([TILE_ROWS + 5, TILE_ROWS + 9])  # odd, and over a tile
    ranks: list[int | None] = [pick([8, 16])] if one_slot else [8, 16, None, pick([8, 16])]
    # in and out not multiples of the kernels' blocks (64): their masks are exercised.
    return make_lora_case(gen, dtype, rows=rows, in_features=pick([48, 96]), slice_width=pick([24, 40]),
                          slices=pick([1, 3]), ranks=ranks, base_share=0.3, one_slot=one_slot,
                          first_slots=(-1, *[0] * (TILE_ROWS + 1)))  # a base row, then a slot over a tile


def check_lora(gen: torch.Generator, dtype: torch.dtype, device: str) -> dict:
    """One random case: the Triton kernel on ``device`` against the reference on the CPU; rows
    without a delta (base rows, a slot without matrices) must come back bit for bit."""
    from kernel_checks import relative_error

    from kvscale.kernels import lora_triton

    case = random_lora_case(gen, dtype)
    x, out, rows, slots = case.on("cpu")
    torch_add_lora(out, x, rows, slots)
    x_dev, actual, rows_dev, slots_dev = case.on(device)
    if not lora_triton.add_lora(actual, x_dev, rows_dev, slots_dev):
        raise AssertionError(f"lora: the kernel declined the case {tuple(x.shape)} {dtype}")
    untouched = [i for i, s in enumerate(case.row_slots) if s < 0 or case.pairs[s] is None]
    exact = torch.equal(actual.cpu()[untouched], case.out[untouched])
    return {"kernel": "lora", "dtype": str(dtype).removeprefix("torch."), "rows": len(case.row_slots),
            "base_rows": sum(s < 0 for s in case.row_slots), "ranks": sorted(set(case.ranks) - {0}),
            "tiles": int(rows.tiles.shape[0]), "slots_present": len(rows.groups),
            "max_error": relative_error(actual, out) if exact else float("inf"),
            "tolerance": LORA_TOLERANCE[dtype]}


# Fused projections' output slices, as the models' q|k|v and gate|up (tests' small widths).
FUSED_SLICES = {"plain": (), "qkv": (40, 16, 16), "gate_up": (56, 56)}


def check_a_slice_its_adapter_leaves_alone(add_lora: Callable[[Tensor, Tensor, Any, LoRASlots], None]) -> None:
    """An adapter on k only (PEFT's target_modules=["k_proj"]): q's and v's blocks are zeros, so
    ``add_lora`` (a CPU form of the contract: x, out, the step's rows, the slots) must leave q's and
    v's outputs of its rows bit for bit and add k's delta."""
    gen = torch.Generator().manual_seed(4)
    case = make_lora_case(gen, torch.float32, rows=9, in_features=48, slice_width=0, slices=0, ranks=[8, 8],
                          base_share=0.0, first_slots=(0, 1), fused=FUSED_SLICES["qkv"])
    a, b = case.pairs[1]
    a[:8] = a[16:] = 0
    b[:, :8] = b[:, 16:] = 0
    x, actual, rows, slots = case.on("cpu")
    add_lora(actual, x, rows, slots)
    only_k = [i for i, s in enumerate(case.row_slots) if s == 1]
    q_and_v = list(range(40)) + list(range(56, 72))
    assert torch.equal(actual[only_k][:, q_and_v], case.out[only_k][:, q_and_v])
    assert float((actual.double() - case.per_row()).abs().max()) < 1e-5
