"""bench.lora_dense_pick's one case: every CPU form of the batched LoRA contract timed on one
projection, and the pick each path rule makes there."""

from __future__ import annotations

import torch

from bench.lora_dense_pick import SHAPES, one_case
from kvscale.kernels import lora_cpu


def test_one_case_times_every_form_and_records_both_picks():
    case = one_case(16, 8, 2, SHAPES["o_proj"], torch.float32, 0.01)
    assert case["rows"] == 16 and case["present"] == 2
    assert case["reference_us"] > 0 and case["dense_us"] > 0 and case["base_linear_us"] > 0
    assert isinstance(case["picked_stacked"], bool)
    assert case["picked_native"] == lora_cpu.native_pays(16, 2, torch.float32, True, lora_cpu.native_available())
    assert ("native_us" in case) == lora_cpu.native_available()
