"""One generated sample (a Sequence) and the request that owns one or more of them."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.outputs import PositionLogprobs, RequestMetrics
from kvscale.server.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()

# A sequence's last token while its sampled one is still on the device (server/core/async_scheduling.py).
PLACEHOLDER_TOKEN = -1


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in the cache; the rest are computed by the coming steps.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks at the start of token_ids (computed lazily).
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading table blocks already findable by hash
    # The sliding-window layers' blocks, indexed as block_table, where the KV cache has a window
    # group (server/core/window_group.py); its first window_freed entries are freed.
    window_table: list[int] = field(default_factory=list)
    window_freed: int = 0
    # >1 while the prompt is prefilled once for n samples; the first sample forks the rest.
    fork_into: int = 1
    preempted: bool = False  # waiting again after a preemption (admission_order.py)
    # Steps in a row it was left out of for a more urgent prefill (urgent_prefill.py).
    skipped_steps: int = 0
    generator: Any = None  # torch.Generator for seeded sampling
    # Detokenization state (see detokenizer.py).
    text: str = ""
    detok_base: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list[PositionLogprobs] | None = None
    # What earlier delta outputs carried (characters of text, output tokens).
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: all but a trailing placeholder."""
        return len(self.token_ids) - (self.token_ids[-1] == PLACEHOLDER_TOKEN)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    metrics: RequestMetrics
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    # With params.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it); shared by all n samples, since they share the prompt.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once
    prompt_sent: bool = False  # delta outputs carry the prompt (text, token ids) once
    # The HTTP request this one came from: admission is fair across groups (admission_order.py).
    # Empty: a group of its own.
    group: str = ""
    # The tenant the router named (docs/server.md, "Tenants"): admission is fair across tenants
    # first. Empty: no tenant, one share for all such requests.
    tenant: str = ""
    # The LoRA adapter serving this request (docs/server.md, "LoRA adapters"); None: the base
    # model. Its name keys the prefix cache's first block (kvscale/block_hash.py).
    lora_name: str | None = None
    # Under --scheduling-policy priority, lower first (server/core/priority_order.py); 0 by default.
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # most requests: no generator per call
            return seqs[0].finish_reason is not None and seqs[0].fork_into == 1
        return bool(seqs) and all(seq.is_finished for seq in seqs) and all(seq.fork_into == 1 for seq in seqs)
