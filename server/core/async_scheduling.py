"""Asynchronous scheduling: the next step is scheduled and launched before this one's tokens are read.

On a GPU the forward is queued, not run, by the host: a synchronous step waits for its sampled
tokens, then spends milliseconds on outputs, scheduling and the next step's inputs while the GPU
idles (docs/performance.md, "GPU: the decode step and the kernels": ~4 ms of host per step at 256
sequences beside ~2.5 ms of GPU work). With this on, step N+1 is scheduled and queued right behind
step N; its decode rows take their input token from step N's sampled tokens *on the device*, and
only then does the host wait for step N's tokens (a copy to pinned memory behind an event, so not
for step N+1) and turn them into outputs while the GPU runs step N+1. vLLM calls this async
scheduling.

What that costs, and why it stays correct:
- Until its token is read, a sequence carries ``PLACEHOLDER_TOKEN`` as its last token; the
  scheduler counts it (one new token to compute) but never hashes it (``num_known_tokens``).
- A sequence found finished (end token, stop, aborted) after its next step was queued has that
  step's row computed for nothing; the row's token is dropped. Its KV went into a slot of its own
  block, which is freed like any other, and later writers queue behind it on the same stream.
- Only requests whose every token the device alone picks can overlap (``can_overlap``): greedy,
  no logprobs, penalties, bias, min_tokens, n > 1 or grammar. With any other request in the engine
  the in-flight step is finished first and steps run synchronously, as before.
- Outputs come one step later than a synchronous engine sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvscale.server.core.sequence import Sequence
from kvscale.server.sampling_params import SamplingParams


def can_overlap(params: SamplingParams) -> bool:
    """Whether a request's tokens can be picked on the device alone, with no host look at the
    logits and no host state between two of its steps."""
    return (
        params.greedy
        and params.n == 1
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and not params.logit_bias
        and params.min_tokens == 0
        and params.structured_outputs is None
    )


def use_async_scheduling(flag: bool | None, device: torch.device) -> bool:
    """``--async-scheduling`` as given, or by default where it can overlap anything: on a GPU. On
    CPU the host runs the forward itself, so there is nothing to overlap it with."""
    return device.type == "cuda" if flag is None else flag


@dataclass
class InFlightStep:
    """A queued step's sampled tokens: one per row of ``seqs``, in order."""

    seqs: list[Sequence]
    device_tokens: torch.Tensor  # where the next step's decode rows read their inputs from
    host_tokens: torch.Tensor  # filled by a copy queued behind the step
    ready: torch.cuda.Event | None  # recorded after that copy; None on CPU (already there)
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> row

    @classmethod
    def start(cls, seqs: list[Sequence], device_tokens: torch.Tensor) -> InFlightStep:
        if device_tokens.device.type == "cpu":
            host, ready = device_tokens, None
        else:
            host = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            host.copy_(device_tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return cls(seqs, device_tokens, host, ready, {seq.seq_id: row for row, seq in enumerate(seqs)})

    def tokens(self) -> list[int]:
        """The sampled tokens; waits for this step only, not for steps queued after it."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()
