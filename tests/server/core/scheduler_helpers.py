"""What the scheduler tests share: a request's one sequence, and one step applied as the engine
applies it (KV computed, a token appended where sampled, finished at max_tokens)."""

from __future__ import annotations

from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.scheduler import Scheduler, SchedulerOutput
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.outputs import RequestMetrics
from kvscale.server.sampling_params import SamplingParams


def make_seq(name: str, prompt_len: int, priority: int, max_tokens: int = 6) -> Sequence:
    tokens = [hash(name) % 50 + 100 * i for i in range(prompt_len)]
    request = Request(name, None, tokens, SamplingParams(max_tokens=max_tokens), None,
                      RequestMetrics(0.0), max_tokens, priority=priority)
    seq = Sequence(request, 0, list(tokens), prompt_len)
    request.seqs.append(seq)
    return seq


def apply_step(scheduler: Scheduler, kv: KVCacheManager, out: SchedulerOutput) -> list[Sequence]:
    """Apply one scheduled step as the engine would; returns the sequences that finished."""
    kv.take_pending_copies()
    done = []
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.request.max_tokens:
                seq.finish_reason = "length"
                scheduler.finish(seq)
                done.append(seq)
    return done
