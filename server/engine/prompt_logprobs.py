"""``prompt_logprobs``: each prompt token's log-probability, recorded from the step that computed it.

The runner makes logits rows for the prompt only for requests that asked for them (``StepLogits``'s
``prompt_rows``); a prompt recomputed after preemption writes the same values again.
"""

from __future__ import annotations

import torch

from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.worker.model_runner import StepLogits
from kvscale.server.worker.sampler import Sampler


def record_prompt_logprobs(sampler: Sampler, scheduled: list[ScheduledSeq], step_logits: StepLogits) -> None:
    all_logprobs = torch.log_softmax(step_logits.prompt, dim=1)
    offset = 0
    for rows in step_logits.prompt_rows:
        seq = scheduled[rows.sched_index].seq
        request = seq.request
        recorded = request.prompt_logprobs
        assert recorded is not None, "prompt rows exist only for requests that asked for them"
        for k in range(rows.count):
            token_index = rows.first_token + k
            recorded[token_index] = sampler.position_logprobs(
                all_logprobs[offset + k], seq.token_ids[token_index], request.params.prompt_logprobs
            )
        offset += rows.count
