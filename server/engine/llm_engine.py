"""LLMEngine: requests in, one scheduling + forward + sampling iteration per ``step()``, outputs out.

The HTTP server and the offline ``LLM`` both drive this: ``add_request`` / ``abort_request`` /
``step``. A request's outputs are cumulative, or deltas for the server (output_builder.py); a
finished request is reported once with ``finished=True`` and forgotten. Its parts are built
once (engine_build.py: model, KV pool sized by kv_sizing.py, scheduler, runner, sampler), a
request's sequences by new_sequences.py; the engine owns the step loop, and asks stop_checks.py whether each token ends its sample; its stats
are engine_stats.py's.
With async scheduling (a GPU's default, async_scheduling.py) a ``step()`` queues the next
iteration and returns the outputs of the one before it.
"""

from __future__ import annotations

import logging
import time

from kvscale.server.config import EngineConfig
from kvscale.server.core.async_scheduling import InFlightStep, can_overlap, use_async_scheduling
from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.core.sequence import PLACEHOLDER_TOKEN, Request, Sequence, SequenceStatus
from kvscale.server.core.step_undo import take_snapshot
from kvscale.server.engine.detokenizer import detokenize_incrementally
from kvscale.server.engine.engine_build import build_engine
from kvscale.server.engine.engine_stats import engine_stats
from kvscale.server.engine.interruptible_forward import interruptible_layers, run_forward
from kvscale.server.engine.new_sequences import fork_samples, new_request
from kvscale.server.engine.output_builder import OutputKind, build_output
from kvscale.server.engine.prompt_logprobs import record_prompt_logprobs
from kvscale.server.engine.spec_step import SpecDecoder
from kvscale.server.engine.stop_checks import check_stop
from kvscale.server.outputs import (
    EngineStats,
    KVEvent,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.kv_cache_dtype import kv_cache_dtype_name
from kvscale.server.worker.sampler import SamplingRow, greedy_tokens

# With only grammars compiling, a step waits this long for one instead of spinning.
GRAMMAR_WAIT_S = 0.005

logger = logging.getLogger(__name__)


class LLMEngine:
    # What a step hands back for each request it touched (output_builder.py): the server takes
    # deltas (no per-step copy of the whole text, token ids and logprobs), the offline LLM only
    # finished requests.
    output_kind = OutputKind.CUMULATIVE
    # The core process clears this: its front end turns token ids into text and ends a sample at
    # a stop string (kvscale.server.engine.output_text), so the core's steps spend nothing on text.
    detokenize = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine(config)
        self.model_path = parts.model_path
        self.model_name = parts.model_name
        self.tokenizer = parts.tokenizer
        self.device = parts.device
        self.dtype = parts.dtype
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.model = parts.model
        self.block_size = config.block_size
        self.vocab_size = parts.model.spec.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.sampler = parts.sampler
        self.runner = parts.runner
        self.step_profile = parts.step_profile
        self.num_blocks = parts.num_blocks
        self.kv_cache_bytes = parts.kv_cache_bytes
        self.max_model_len = parts.max_model_len
        self.num_host_blocks = parts.num_host_blocks
        self.pool = parts.pool
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.structured = parts.structured
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.last_step_s = 0.0
        # --speculative-config (spec_step.py; synchronous steps), and the verified tokens to append.
        self.spec = SpecDecoder.for_engine(config, self.kv, self.max_model_len)
        self.spec_rest: dict[Sequence, list[int]] = {}
        self.async_scheduling = use_async_scheduling(config.async_scheduling, self.device) and self.spec is None
        self.in_flight: InFlightStep | None = None  # the step queued, its tokens not read yet
        # Requests that need the host between two of their steps (async_scheduling.can_overlap):
        # while there is one, steps run synchronously.
        self.sync_request_ids: set[str] = set()
        # Under priority scheduling on a CPU, a forward given up for a more urgent arrival
        # (step_interrupt.py): the core's input thread calls step_interrupt.on_arrival.
        self.step_interrupt = interruptible_layers(config, self.device.type, self.model, self.async_scheduling)
        self.step_given_up = False  # this step's forward was given up
        if self.async_scheduling:
            logger.info("kvscale engine: async scheduling on (the next step is queued before this one's "
                        "tokens are read; --no-async-scheduling turns it off)")

    # --- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        group: str = "", tenant: str = "", lora_name: str | None = None, priority: int = 0,  # Request's fields
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        request = new_request(self, request_id, prompt, params, metrics, cache_salt=cache_salt, group=group,
                              tenant=tenant, lora_name=lora_name, priority=priority)
        self.requests[request_id] = request
        if not can_overlap(params):
            self.sync_request_ids.add(request_id)
        if params.structured_outputs is not None:
            # Waits for its grammar here, outside the scheduler, while the batch runs on.
            self.structured.submit(request)
            return
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.status != SequenceStatus.FINISHED:
                self.scheduler.finish(seq)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        request.metrics.finished_time = time.monotonic()
        self._forget(request)

    def _forget(self, request: Request) -> None:
        """A request leaves the engine: finished, aborted or refused."""
        request.finished = True
        self.requests.pop(request.request_id, None)
        self.sync_request_ids.discard(request.request_id)
        self.structured.release(request)
        if self.spec is not None:
            self.spec.forget(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        prompt_before = self.num_prompt_tokens_computed
        self.step_given_up = False
        try:
            return self._step()
        finally:
            # Heartbeats report step times (router's TTFT prediction); every return path counts,
            # but a forward given up part way (step_interrupt.py) is no step.
            if not self.step_given_up:
                self.last_step_s = time.perf_counter() - started
                self._observe_rates(self.num_prompt_tokens_computed - prompt_before)

    def _observe_rates(self, prompt_tokens: int) -> None:
        """The prefill rate (/metrics: the autoscaler's queued prefill seconds; the host tier's
        swap-or-recompute choice) and, with a host tier, its copy rate."""
        decoding = sum(1 for seq in self.scheduler.running if seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.scheduler.step_rates.observe(self.last_step_s, prompt_tokens, decoding)
        host_cache = self.runner.host_cache
        if host_cache is not None:
            self.scheduler.copy_bytes_per_s = host_cache.counters.copy_bytes_per_s

    def _step(self) -> list[RequestOutput]:
        if self.async_scheduling and not self.sync_request_ids:
            return self._step_overlapped()
        # Some request needs the host between its steps: the queued step's tokens come first.
        outputs = self._finish_in_flight()
        outputs += self._step_sync()
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        refused = self._admit_compiled()
        snapshot = take_snapshot(self.scheduler) if self.step_interrupt is not None else None
        sched = self.scheduler.schedule()
        # Before the forward (demoted blocks may be written by it, promoted ones read), and even
        # when nothing runs: a preemption may have queued demotions.
        tier_copies, window_copies = self.kv.take_tier_copies(), self.kv.take_pending_window_copies()
        self.runner.move_between_tiers(tier_copies)
        self.runner.copy_window_blocks(window_copies)
        if not sched.scheduled:
            if not refused and self.structured.has_pending():
                self.structured.wait(GRAMMAR_WAIT_S)
            return refused
        scheduled_at = self._mark_scheduled(sched.scheduled)
        # The masks of the rows that will sample, filled while the forward runs.
        self.structured.start_masks([item.seq for item in sched.scheduled
                                     if item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens])
        drafted = self.spec.attach(sched) if self.spec is not None else None
        copies = self.kv.take_pending_copies()
        with self.structured.forward_running():
            step_logits = run_forward(self, sched, snapshot, scheduled_at, copies,
                                      bool(tier_copies or window_copies or copies), drafted.rows if drafted else None)
        if step_logits is None:
            return refused
        logits, sample_rows = step_logits.sample, step_logits.sample_rows
        if step_logits.prompt_rows:
            record_prompt_logprobs(self.sampler, sched.scheduled, step_logits)
        self._count_computed(sched.scheduled)

        # Rows to sample: one per sequence, n per prompt that has just been prefilled for n samples.
        row_seqs: list[Sequence] = []
        row_logits: list[int] = []
        for logits_row, sched_index in enumerate(sample_rows):
            seq = sched.scheduled[sched_index].seq
            row_seqs.append(seq)
            row_logits.append(logits_row)
            if seq.fork_into > 1:
                for child in fork_samples(self, seq):
                    row_seqs.append(child)
                    row_logits.append(logits_row)
        if not row_seqs:
            return refused
        if row_logits != list(range(len(row_logits))):
            logits = logits[row_logits]
        # Grammars first: penalties, logit_bias and sampling then see only allowed tokens.
        self.structured.apply(logits, row_seqs)
        rows = [
            SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, seq.generator) for seq in row_seqs
        ]
        tokens, logprobs = self.sampler(logits, rows)
        if drafted is None:
            return self._take_tokens(row_seqs, tokens, logprobs, refused)
        self.spec_rest = drafted.verify(row_seqs, tokens, step_logits.extra)
        outputs = self._take_tokens(row_seqs, tokens, logprobs, refused)
        self.spec_rest = drafted.settle()  # none kept for a sequence that ended before them
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Queue this step behind the one in flight, then read that one's tokens while the device
        runs this one (server/core/async_scheduling.py)."""
        sched = self.scheduler.schedule()
        self.runner.move_between_tiers(self.kv.take_tier_copies())
        self.runner.copy_window_blocks(self.kv.take_pending_window_copies())
        if not sched.scheduled:
            return self._finish_in_flight()
        self._mark_scheduled(sched.scheduled)
        step_logits = self.runner.execute(sched.scheduled, self.kv.take_pending_copies(), self.in_flight)
        self._count_computed(sched.scheduled)
        seqs = [sched.scheduled[i].seq for i in step_logits.sample_rows]
        queued = InFlightStep.start(seqs, greedy_tokens(step_logits.sample)) if seqs else None
        outputs = self._finish_in_flight()
        unfinished = [seq for seq in seqs if not seq.is_finished]
        for seq in unfinished:
            seq.token_ids.append(PLACEHOLDER_TOKEN)
        # A step whose every row ended meanwhile is left to run unread: nothing waits for it.
        self.in_flight = queued if unfinished else None
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """The in-flight step's tokens in place of their placeholders, and the outputs they make."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return []
        row_seqs: list[Sequence] = []
        tokens: list[int] = []
        for seq, token in zip(flight.seqs, flight.tokens(), strict=True):
            if seq.is_finished:
                continue  # ended (or aborted) after this step was queued: its row ran for nothing
            placeholder = seq.token_ids.pop()
            assert placeholder == PLACEHOLDER_TOKEN
            row_seqs.append(seq)
            tokens.append(token)
        return self._take_tokens(row_seqs, tokens, [None] * len(tokens), [])

    def _mark_scheduled(self, scheduled: list[ScheduledSeq]) -> float:
        now = time.monotonic()
        for item in scheduled:
            request = item.seq.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = item.seq.num_computed_tokens
        return now

    def _count_computed(self, scheduled: list[ScheduledSeq]) -> None:
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += item.num_new_tokens

    def _take_tokens(
        self, row_seqs: list[Sequence], tokens: list[int], logprobs: list[PositionLogprobs | None],
        outputs: list[RequestOutput],
    ) -> list[RequestOutput]:
        """Append each row's sampled token (and a grammar's forced ones) to its sequence, end the
        sequences that are done, and add an output per request touched to ``outputs``."""
        now = time.monotonic()
        touched: dict[str, Request] = {}
        generated = len(tokens)
        for seq, token, position_logprobs in zip(row_seqs, tokens, logprobs, strict=True):
            self._append_token(seq, token, position_logprobs)
            generated += self._fast_forward(seq)
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            touched[request.request_id] = request
            if seq.is_finished:
                self.scheduler.finish(seq)
        self.num_generated_tokens += generated

        for request in touched.values():
            finished = request.is_finished
            if finished:
                request.metrics.finished_time = now
                self._forget(request)
            output = build_output(self.output_kind, request, finished)
            if output is not None:
                outputs.append(output)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready go to the scheduler; those whose grammar failed end now,
        before any token, with the error their client gets (a 400, or a 503 when it waited too long)."""
        ready, failed = self.structured.poll()
        for request in ready:
            for seq in request.seqs:
                self.scheduler.add(seq)
        outputs = []
        now = time.monotonic()
        for request, failure in failed:
            for seq in request.seqs:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
            request.metrics.finished_time = now
            self._forget(request)
            output = build_output(self.output_kind, request, True)
            assert output is not None  # every kind sends a finished request
            output.error, output.error_reason = failure.message, failure.reason
            outputs.append(output)
        return outputs

    def _fast_forward(self, seq: Sequence) -> int:
        """Append the tokens ``seq``'s grammar forces after its sampled one, each through the same
        end-of-sequence checks as a sampled token (so max_tokens cuts the run); the next step
        computes their KV together with the next logits as one chunk (the scheduler gives a
        running sequence every token it has not computed). Or, after a speculative step, the
        verified tokens after its first one (spec_step.py). Returns how many were appended."""
        if seq.is_finished:
            return 0
        appended = 0
        verified = self.spec_rest.pop(seq, None) if self.spec_rest else None
        for token in verified if verified is not None else self.structured.forced_tokens(seq):
            self._append_token(seq, token, None)
            appended += 1
            if seq.is_finished:
                break
        if verified is None:
            self.structured.stats.forced_tokens += appended
        return appended

    def _append_token(self, seq: Sequence, token: int, position_logprobs: PositionLogprobs | None) -> None:
        seq.token_ids.append(token)
        if position_logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(position_logprobs)
        piece = detokenize_incrementally(self.tokenizer, seq) if self.detokenize else ""
        grammar_done = self.structured.accept(seq, token)
        check_stop(seq, token, piece_len=len(piece), grammar_done=grammar_done,
                   eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        stats = engine_stats(
            self.scheduler, self.kv, num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed, last_step_s=self.last_step_s,
            offload=self.runner.host_cache.counters if self.runner.host_cache is not None else None,
            lora=self.runner.lora)
        stats.extra.update(self.structured.extra_stats() | (self.spec.extra_stats() if self.spec is not None else {}))
        stats.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)
        return stats

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.kv.window is not None:  # no sequence holds a block of either group now
            self.kv.window.pool.reset_prefix_cache()
        return True
