"""Sampling where the logits live (the GPU path): plain greedy rows become token ids on the device
and only the rows that need full logits go to the host. On the CPU the same split is run
directly and must give exactly what the all-host path gives."""

from __future__ import annotations

import pytest
import torch

from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.sampler import Sampler, SamplingRow, make_generator, needs_host_logits

VOCAB = 300


def row(params: SamplingParams, generated: int = 3) -> SamplingRow:
    tokens = list(range(5, 15)) + list(range(20, 20 + generated))
    return SamplingRow(params, tokens, 10, make_generator(params.seed, 0))


@pytest.mark.parametrize(
    ("params", "host"),
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.0, logprobs=0), True),
        (SamplingParams(temperature=0.0, repetition_penalty=1.2), True),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), True),
        (SamplingParams(temperature=0.0, frequency_penalty=0.5), True),
        (SamplingParams(temperature=0.0, min_tokens=10), True),  # 3 generated < 10: EOS masked
        (SamplingParams(temperature=0.0, min_tokens=2), False),
        (SamplingParams(temperature=0.8), True),
    ],
)
def test_which_rows_need_host_logits(params, host):
    assert needs_host_logits(row(params)) is host


def mixed_rows() -> list[SamplingRow]:
    return [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.7, seed=11)),
        row(SamplingParams(temperature=0.0, logprobs=2)),
        row(SamplingParams(temperature=1.0, top_p=0.9)),  # unseeded: the sampler's own generator
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5)),
        row(SamplingParams(temperature=0.0, min_tokens=10)),
        row(SamplingParams(temperature=1.2, top_k=5)),
    ]


def test_device_split_equals_host_path():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    logits[6, 2] = 100.0  # the EOS that min_tokens must hide
    host = Sampler({2}, str, seed=7)(logits.clone(), mixed_rows())
    split = Sampler({2}, str, seed=7).sample_on_device(logits.clone(), mixed_rows())
    assert split == host
    tokens, logprobs = split
    assert tokens[6] != 2
    assert logprobs[2] is not None and logprobs[0] is None


def test_all_greedy_rows_need_no_host_logits():
    logits = torch.randn(4, VOCAB)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(4)]
    tokens, logprobs = Sampler(set(), str).sample_on_device(logits, rows)
    assert tokens == logits.argmax(dim=1).tolist()
    assert logprobs == [None] * 4
