"""LLMEngine: requests in, one scheduling + forward + sampling iteration per ``step()``, outputs out.

The HTTP server and the offline ``LLM`` both drive this: ``add_request`` / ``abort_request`` /
``step``. A request's outputs are cumulative, or deltas for the server (output_builder.py); a
finished request is reported once with ``finished=True`` and forgotten. The engine wires the
parts together at construction (model, KV pool sized by kv_sizing.py, scheduler, runner,
sampler) and owns the step loop and the end-of-sequence checks; its stats are engine_stats.py's.
With async scheduling (a GPU's default, async_scheduling.py) a ``step()`` queues the next
iteration and returns the outputs of the one before it.
"""

from __future__ import annotations

import logging
import time

import torch

from kvscale.model_files import load_tokenizer, resolve_model_path, served_model_name
from kvscale.server.async_scheduling import InFlightStep, can_overlap, use_async_scheduling
from kvscale.server.block_pool import BlockPool
from kvscale.server.config import EngineConfig
from kvscale.server.detokenizer import detokenize_incrementally, find_stop_string, init_detokenizer
from kvscale.server.engine_stats import engine_stats
from kvscale.server.host_tier import HostTier
from kvscale.server.kv_cache_dtype import kv_cache_dtype_name, resolve_kv_cache_dtype
from kvscale.server.kv_cache_manager import KVCacheManager, blocks_for
from kvscale.server.kv_sizing import (
    host_memory_room,
    host_tier_blocks,
    largest_step_profile,
    pass_decides_pool,
    pool_blocks,
)
from kvscale.server.memory_profile import device_memory
from kvscale.server.model_loader import (
    eos_token_ids,
    load_hf_config,
    load_model,
    resolve_device,
    resolve_dtype,
)
from kvscale.server.model_runner import ModelRunner, StepLogits, StepProfile, kv_block_bytes
from kvscale.server.output_builder import OutputKind, build_output
from kvscale.server.outputs import (
    EngineStats,
    KVEvent,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvscale.server.sampler import Sampler, SamplingRow, greedy_tokens, make_generator
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.scheduler import ScheduledSeq, Scheduler
from kvscale.server.sequence import PLACEHOLDER_TOKEN, Request, Sequence, SequenceStatus
from kvscale.server.structured_outputs.manager import StructuredOutputManager

# With only grammars compiling, a step waits this long for one instead of spinning.
GRAMMAR_WAIT_S = 0.005

logger = logging.getLogger(__name__)


class LLMEngine:
    # What a step hands back for each request it touched (output_builder.py): the server takes
    # deltas (no per-step copy of the whole text, token ids and logprobs), the offline LLM only
    # finished requests.
    output_kind = OutputKind.CUMULATIVE
    # The core process clears this: its front end turns token ids into text and ends a sample at
    # a stop string (kvscale.server.output_text), so the core's steps spend nothing on text.
    detokenize = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_name = served_model_name(config.model, config.served_model_name)
        self.tokenizer = load_tokenizer(path)
        hf_config = load_hf_config(path)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        # Before the weights load: a cache dtype this backend cannot read is refused at once.
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.model = load_model(path, hf_config, self.dtype, self.device, config.quantization)
        spec = self.model.spec
        self.block_size = config.block_size

        model_max_len = spec.max_position_embeddings
        if spec.sliding_window:
            # Attention here is always full; beyond the window the model would differ.
            model_max_len = min(model_max_len, spec.sliding_window)
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds what the model supports ({model_max_len})"
            )
        wanted_len = config.max_model_len or model_max_len

        block_bytes = kv_block_bytes(spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim,
                                     self.kv_cache_dtype)
        self.eos_token_ids = eos_token_ids(self.tokenizer, path)
        self.sampler = Sampler(self.eos_token_ids, self._decode_token, seed=config.seed)
        self.runner = ModelRunner(self.model, config.block_size, self.dtype, self.device,
                                  kv_cache_dtype=self.kv_cache_dtype)
        used = total = 0
        if self.device.type == "cuda":
            # RoPE tables for the longest possible sequence first: they stay for the engine's
            # life, so they count as used, like the weights (and whatever else holds the card).
            self.model.build_rope_cache(wanted_len)
            used, total = device_memory(self.device)
        self.step_profile: StepProfile | None = None
        if pass_decides_pool(self.device.type, config.kv_cache_memory_bytes, config.num_gpu_blocks_override):
            self.step_profile = largest_step_profile(self.runner, self.sampler, config, wanted_len)
        self.num_blocks = pool_blocks(config, block_bytes, used, total, self.step_profile)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        # A sequence may never need more than the whole pool (so preemption always makes progress).
        self.max_model_len = min(wanted_len, self.num_blocks * config.block_size)

        # The host tier (--kv-offloading-size): checked against the machine before anything is
        # allocated; on CPU the KV cache itself is host memory too.
        room, room_what = host_memory_room()
        self.num_host_blocks = host_tier_blocks(
            config.kv_offloading_size, block_bytes, host_room_bytes=room, host_room_what=room_what,
            other_host_bytes=self.kv_cache_bytes if self.device.type == "cpu" else 0,
        ) if config.enable_prefix_caching else 0
        host = HostTier(self.num_host_blocks) if self.num_host_blocks else None
        self.pool = BlockPool(self.num_blocks, config.block_size, config.enable_prefix_caching, host)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.block_bytes = block_bytes
        self.runner.allocate_kv_cache(self.num_blocks, self.max_model_len)
        if self.device.type == "cuda" and not config.enforce_eager:
            started = time.perf_counter()
            self.runner.capture_decode_graphs(config.max_num_seqs)
            logger.info("kvscale engine: captured decode CUDA graphs for batch sizes up to %d in %.1f s "
                        "(--enforce-eager turns them off)", config.max_num_seqs, time.perf_counter() - started)
        if self.num_host_blocks:
            self.runner.allocate_host_cache(self.num_host_blocks)
        self.vocab_size = spec.vocab_size
        self.requests: dict[str, Request] = {}
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  config.structured_outputs_config)
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.last_step_s = 0.0
        self.async_scheduling = use_async_scheduling(config.async_scheduling, self.device)
        self.in_flight: InFlightStep | None = None  # the step queued, its tokens not read yet
        # Requests that need the host between two of their steps (async_scheduling.can_overlap):
        # while there is one, steps run synchronously.
        self.sync_request_ids: set[str] = set()
        logger.info(
            "kvscale engine: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB, KV cache dtype %s), max_model_len %d",
            self.model_name, self.device, self.dtype, self.num_blocks, self.block_size,
            self.kv_cache_bytes / 2**20, kv_cache_dtype_name(self.kv_cache_dtype), self.max_model_len,
        )
        if self.async_scheduling:
            logger.info("kvscale engine: async scheduling on (the next step is queued before this one's "
                        "tokens are read; --no-async-scheduling turns it off)")

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # --- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The edges (the HTTP API, the offline LLM) validate requests with kvscale.server.admission,
        # one message per failure; here the same conditions are only asserted.
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text = None
            token_ids = [int(t) for t in prompt]
        num_prompt = len(token_ids)
        assert num_prompt and all(0 <= t < self.vocab_size for t in token_ids), "unchecked prompt"
        max_tokens = self.max_model_len - num_prompt if params.max_tokens is None else params.max_tokens
        assert max_tokens >= 1 and num_prompt + max_tokens <= self.max_model_len, "unchecked max_tokens"
        # max_model_len is capped by the pool, so a request within it always fits the pool.
        assert blocks_for(num_prompt + max_tokens, self.block_size) <= self.num_blocks
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        request = Request(request_id, prompt_text, token_ids, params, cache_salt, metrics, max_tokens)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * num_prompt
        seq = Sequence(request, 0, list(token_ids), num_prompt, fork_into=params.n)
        seq.generator = make_generator(params.seed, 0)
        init_detokenizer(seq)
        request.seqs.append(seq)
        self.requests[request_id] = request
        if not can_overlap(params):
            self.sync_request_ids.add(request_id)
        if params.structured_outputs is not None:
            # Waits for its grammar here, outside the scheduler, while the batch runs on.
            self.structured.submit(request)
            return
        self.scheduler.add(seq)

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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        prompt_before = self.num_prompt_tokens_computed
        try:
            return self._step()
        finally:
            # Heartbeats report step times (router's TTFT prediction); every return path counts.
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
        sched = self.scheduler.schedule()
        # Before the forward (demoted blocks may be written by it, promoted ones read), and even
        # when nothing runs: a preemption may have queued demotions.
        self.runner.move_between_tiers(self.kv.take_tier_copies())
        if not sched.scheduled:
            if not refused and self.structured.has_pending():
                self.structured.wait(GRAMMAR_WAIT_S)
            return refused
        self.structured.engine_busy()
        self._mark_scheduled(sched.scheduled)
        # The masks of the rows that will sample, filled while the forward runs.
        self.structured.start_masks([item.seq for item in sched.scheduled
                                     if item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens])
        step_logits = self.runner.execute(sched.scheduled, self.kv.take_pending_copies())
        logits, sample_rows = step_logits.sample, step_logits.sample_rows
        if step_logits.prompt_rows:
            self._record_prompt_logprobs(sched.scheduled, step_logits)
        self._count_computed(sched.scheduled)

        # Rows to sample: one per sequence, n per prompt that has just been prefilled for n samples.
        row_seqs: list[Sequence] = []
        row_logits: list[int] = []
        for logits_row, sched_index in enumerate(sample_rows):
            seq = sched.scheduled[sched_index].seq
            row_seqs.append(seq)
            row_logits.append(logits_row)
            if seq.fork_into > 1:
                for child in self._fork(seq):
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
        return self._take_tokens(row_seqs, tokens, logprobs, refused)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Queue this step behind the one in flight, then read that one's tokens while the device
        runs this one (server/async_scheduling.py)."""
        sched = self.scheduler.schedule()
        self.runner.move_between_tiers(self.kv.take_tier_copies())
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

    def _mark_scheduled(self, scheduled: list[ScheduledSeq]) -> None:
        now = time.monotonic()
        for item in scheduled:
            request = item.seq.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = item.seq.num_computed_tokens

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

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSeq], step_logits: StepLogits) -> None:
        # A recomputed prompt (after preemption) writes the same values again.
        all_logprobs = torch.log_softmax(step_logits.prompt, dim=1)
        offset = 0
        for rows in step_logits.prompt_rows:
            seq = scheduled[rows.sched_index].seq
            request = seq.request
            recorded = request.prompt_logprobs
            # The runner makes prompt rows only for requests that asked for prompt logprobs.
            assert recorded is not None
            for k in range(rows.count):
                token_index = rows.first_token + k
                recorded[token_index] = self.sampler.position_logprobs(
                    all_logprobs[offset + k], seq.token_ids[token_index], request.params.prompt_logprobs
                )
            offset += rows.count

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The other n-1 samples of a just-prefilled prompt, sharing its blocks."""
        request = parent.request
        children = []
        for index in range(1, parent.fork_into):
            child = Sequence(request, index, list(parent.token_ids), parent.num_prompt_tokens)
            self.kv.fork(parent, child)
            child.generator = make_generator(request.params.seed, index)
            init_detokenizer(child)
            self.structured.fork(parent, child)
            request.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        parent.fork_into = 1
        return children

    def _fast_forward(self, seq: Sequence) -> int:
        """Append the tokens ``seq``'s grammar forces after its sampled one, each through the same
        end-of-sequence checks as a sampled token (so max_tokens cuts the run); the next step
        computes their KV together with the next logits as one chunk (the scheduler gives a
        running sequence every token it has not computed). Returns how many were appended."""
        if seq.is_finished:
            return 0
        appended = 0
        for token in self.structured.forced_tokens(seq):
            self._append_token(seq, token, None)
            appended += 1
            if seq.is_finished:
                break
        self.structured.stats.forced_tokens += appended
        return appended

    def _append_token(self, seq: Sequence, token: int, position_logprobs: PositionLogprobs | None) -> None:
        params = seq.params
        seq.token_ids.append(token)
        if position_logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(position_logprobs)
        piece = detokenize_incrementally(self.tokenizer, seq) if self.detokenize else ""
        num_output = seq.num_output_tokens
        grammar_done = self.structured.accept(seq, token)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason = "stop"
                seq.stop_reason = token
                return
            if find_stop_string(seq, len(piece)):
                return
        if grammar_done:
            # Nothing but end-of-sequence can follow: the answer is complete.
            seq.finish_reason = "stop"
            return
        if num_output >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        stats = engine_stats(
            self.scheduler, self.kv, num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed, last_step_s=self.last_step_s,
            offload=self.runner.host_cache.counters if self.runner.host_cache is not None else None,
        )
        stats.extra.update(self.structured.extra_stats())
        stats.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)
        return stats

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
