"""Turn one row of logits per sequence into its next token, batched.

Every row is processed on its own (row-wise softmax/cumsum; one uniform draw per row from the
sequence's own generator when it has a seed), so a seeded request samples the same tokens
alone or inside any batch. Sampling is by inverse CDF: one random number per row instead of a
vocabulary-sized noise tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvscale.server.outputs import Logprob, PositionLogprobs
from kvscale.server.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    generator: torch.Generator | None = None


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    # Different samples (n > 1) of one seeded request must differ, reproducibly.
    generator.manual_seed((seed + index * 1_000_003) % (2**63))
    return generator


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (HF style, prompt + output) and OpenAI presence/frequency (output) penalties."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            values = logits[i, seen]
            logits[i, seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if p.presence_penalty or p.frequency_penalty:
            out = row.token_ids[row.num_prompt_tokens :]
            if out:
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab]
                logits[i] -= p.frequency_penalty * counts.to(logits.dtype)
                logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest (top_k <= 0: keep all)."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    max_k = int(k.max())
    kth = logits.topk(max_k, dim=1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = probs.sort(dim=1, descending=True)
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow], fallback: torch.Generator) -> torch.Tensor:
    """Sample one token per row from temperature/top-k/top-p/min-p filtered distributions."""
    params = [row.params for row in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temperature.unsqueeze(1)
    if any(p.top_k > 0 for p in params):
        logits = _filter_top_k(logits, torch.tensor([p.top_k for p in params]))
    probs = torch.softmax(logits, dim=1)
    if any(p.top_p < 1.0 for p in params):
        probs = _filter_top_p(probs, torch.tensor([p.top_p for p in params], dtype=probs.dtype))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
        threshold = probs.max(dim=1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    cdf = probs.cumsum(dim=1)
    uniform = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), generator=fallback, dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i] = torch.rand(1, generator=row.generator, dtype=torch.float64)
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[1] - 1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's highest-scoring token id (the first such, as ``argmax``).

    ``max(dim)`` rather than ``argmax``: torch's CPU argmax kernel is slower for the same answer,
    once per decode step (``python -m bench.cpu_kernels`` measures both).
    """
    return logits.max(dim=1).indices


def needs_host_logits(row: SamplingRow) -> bool:
    """Whether a row needs its full logits on the host (anything but plain greedy argmax)."""
    p = row.params
    return (
        not p.greedy
        or p.logprobs is not None
        or p.repetition_penalty != 1.0
        or bool(p.presence_penalty)
        or bool(p.frequency_penalty)
        or bool(p.logit_bias)
        or len(row.token_ids) - row.num_prompt_tokens < p.min_tokens
    )


def bias_tensors(bias: dict[int, float], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, values) within the logits' width."""
    ids = torch.tensor([t for t in bias if t < width], dtype=torch.long)
    return ids, torch.tensor([bias[t] for t in ids.tolist()], dtype=torch.float32)


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int]) -> None:
    """Each row's logit_bias added in one scatter for the whole batch; the tensors of a request's
    bias are built once (SamplingParams.derived), not per entry per step (docs/server.md
    "Request limits")."""
    width = logits.shape[1]
    parts = [p.derived("_logit_bias_tensors", p.logit_bias, lambda bias: bias_tensors(bias, width))
             for p in params]
    counts = torch.tensor([len(ids) for ids, _ in parts])
    row_index = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), counts)
    columns = torch.cat([ids for ids, _ in parts])
    values = torch.cat([values for _, values in parts]).to(logits.dtype)
    logits.index_put_((row_index, columns), values, accumulate=True)


class Sampler:
    def __init__(self, eos_token_ids: set[int], decode_token: Callable[[int], str], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.decode_token = decode_token
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[list[int], list[PositionLogprobs | None]]:
        if logits.device.type != "cpu":
            return self.sample_on_device(logits, rows)
        if not any(needs_host_logits(row) for row in rows):
            # Plain greedy rows: the argmax of the model's dtype is the argmax of its exact float32
            # conversion, without a [rows, vocab] float32 copy.
            return greedy_tokens(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=1) if want_logprobs else None

        needs_penalty = [
            i
            for i, row in enumerate(rows)
            if row.params.repetition_penalty != 1.0
            or row.params.presence_penalty
            or row.params.frequency_penalty
        ]
        needs_mask = [
            i
            for i, row in enumerate(rows)
            if len(row.token_ids) - row.num_prompt_tokens < row.params.min_tokens
        ]
        needs_bias = [i for i, row in enumerate(rows) if row.params.logit_bias]
        if needs_penalty or needs_mask or needs_bias:
            logits = logits.clone()
        if needs_penalty:
            sub = logits[needs_penalty]
            apply_penalties(sub, [rows[i] for i in needs_penalty])
            logits[needs_penalty] = sub
        if needs_bias:
            add_logit_bias(logits, [rows[i].params for i in needs_bias], needs_bias)
        for i in needs_mask:
            # Not allowed to end before min_tokens: hide every token that would end it.
            banned = set(rows[i].params.stop_token_set)
            if not rows[i].params.ignore_eos:
                banned |= self.eos_token_ids
            banned_ids = [t for t in banned if t < logits.shape[1]]
            if banned_ids:
                kept = logits[i, banned_ids].clone()
                logits[i, banned_ids] = float("-inf")
                if not torch.isfinite(logits[i]).any():
                    # A grammar that allows only the end leaves nothing else: let it end.
                    logits[i, banned_ids] = kept

        tokens = greedy_tokens(logits)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            sampled = sample_random(logits[random_rows], [rows[i] for i in random_rows], self.generator)
            tokens[random_rows] = sampled
        token_list = tokens.tolist()

        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for j, i in enumerate(want_logprobs):
                logprobs[i] = self.position_logprobs(raw_logprobs[j], token_list[i], rows[i].params.logprobs)
        return token_list, logprobs

    def sample_on_device(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[list[int], list[PositionLogprobs | None]]:
        """Argmax where the logits are, so plain greedy rows send only their token ids to the host
        (no vocabulary-sized copy, no host-side sort); the other rows' logits go to the host and
        take the full path there."""
        token_list = greedy_tokens(logits).tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        host = [i for i, row in enumerate(rows) if needs_host_logits(row)]
        if host:
            host_tokens, host_logprobs = self(logits[host].float().cpu(), [rows[i] for i in host])
            for j, i in enumerate(host):
                token_list[i] = host_tokens[j]
                logprobs[i] = host_logprobs[j]
        return token_list, logprobs

    def position_logprobs(self, row_logprobs: torch.Tensor, chosen: int, top_n: int | None) -> PositionLogprobs:
        """``chosen`` with its logprob and rank, plus the ``top_n`` most likely tokens (0 or None:
        none)."""
        chosen_lp = float(row_logprobs[chosen])
        rank = int((row_logprobs > chosen_lp).sum()) + 1
        result: PositionLogprobs = {chosen: Logprob(chosen_lp, rank, self.decode_token(chosen))}
        if top_n:
            values, ids = row_logprobs.topk(top_n)
            for r, (value, token_id) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
                # A grammar may leave fewer than top_n tokens possible; -inf is no alternative.
                if token_id not in result and value != float("-inf"):
                    result[token_id] = Logprob(value, r + 1, self.decode_token(token_id))
        return result
