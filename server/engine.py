"""LLMEngine: requests in, one scheduling + forward + sampling iteration per ``step()``, outputs out.

The HTTP server and the offline ``LLM`` both drive this: ``add_request`` / ``abort_request`` /
``step``. Outputs are cumulative per request; a finished request is reported once with
``finished=True`` and forgotten.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import replace

import torch

from kvscale.model_files import load_tokenizer, resolve_model_path, served_model_name
from kvscale.server.block_pool import BlockPool
from kvscale.server.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvscale.server.detokenizer import (
    detokenize_incrementally,
    find_stop_string,
    init_detokenizer,
    visible_text,
    visible_text_len,
)
from kvscale.server.kv_cache_manager import KVCacheManager, blocks_for
from kvscale.server.kv_sizing import kv_cache_blocks, pass_decides_pool, profile_shape
from kvscale.server.memory_profile import device_memory
from kvscale.server.model_loader import load_hf_config, load_model, resolve_dtype
from kvscale.server.model_runner import ModelRunner, StepLogits, StepProfile, kv_block_bytes
from kvscale.server.outputs import (
    CompletionOutput,
    EngineStats,
    KVEvent,
    RequestMetrics,
    RequestOutput,
)
from kvscale.server.sampler import Sampler, SamplingRow, make_generator
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.scheduler import ScheduledSeq, Scheduler
from kvscale.server.sequence import Request, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# model -> {(sequence lengths, block size, device): what its profiling pass measured}
_STEP_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class LLMEngine:
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
        self.model = load_model(path, hf_config, self.dtype, self.device)
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

        block_bytes = kv_block_bytes(spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, self.dtype)
        self.eos_token_ids = self._eos_token_ids(path)
        self.sampler = Sampler(self.eos_token_ids, self._decode_token, seed=config.seed)
        self.runner = ModelRunner(self.model, config.block_size, self.dtype, self.device)
        used = total = 0
        if self.device.type == "cuda":
            # RoPE tables for the longest possible sequence first: they stay for the engine's
            # life, so they count as used, like the weights (and whatever else holds the card).
            self.model.build_rope_cache(wanted_len)
            used, total = device_memory(self.device)
        self.step_profile: StepProfile | None = None
        if pass_decides_pool(self.device.type, config.kv_cache_memory_bytes, config.num_gpu_blocks_override):
            self.step_profile = self._profile_largest_step(wanted_len)
        self.num_blocks = self._num_blocks(block_bytes, used, total)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        # A sequence may never need more than the whole pool (so preemption always makes progress).
        self.max_model_len = min(wanted_len, self.num_blocks * config.block_size)

        self.pool = BlockPool(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner.allocate_kv_cache(self.num_blocks, self.max_model_len)
        self.vocab_size = spec.vocab_size
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.last_step_s = 0.0
        logger.info(
            "kvscale engine: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d",
            self.model_name, self.device, self.dtype, self.num_blocks, self.block_size,
            self.kv_cache_bytes / 2**20, self.max_model_len,
        )

    # --- setup helpers ------------------------------------------------------------------
    def _profile_largest_step(self, max_model_len: int) -> StepProfile:
        """Run (or recall) the profiling pass for the largest step this engine can schedule."""
        config = self.config
        lengths = profile_shape(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
        # The same shape on the same weights peaks the same: engines sharing a process's weights
        # (tests, several LLM objects) measure it once.
        key = (tuple(lengths), config.block_size, str(self.device))
        known = _STEP_PROFILES.setdefault(self.model, {})
        profile = known.get(key)
        reused = profile is not None
        if profile is None:
            profile = known[key] = self.runner.profile_run(lengths, self.sampler)
        peak = "not measurable here" if profile.peak_bytes is None else f"+{profile.peak_bytes / 2**20:.1f} MiB"
        logger.info(
            "profiling pass: %d tokens in %d sequences, peak %s%s", profile.num_tokens, profile.num_seqs,
            peak, " (measured earlier in this process)" if reused else f" in {profile.seconds:.1f} s",
        )
        return profile

    def _num_blocks(self, block_bytes: int, used: int, total: int) -> int:
        config = self.config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if self.step_profile is not None:
            # CUDA always has a meter, so the pass always has a peak.
            assert self.step_profile.peak_bytes is not None
            return kv_cache_blocks(
                total, used, self.step_profile.peak_bytes, config.gpu_memory_utilization, block_bytes,
                block_size=config.block_size, max_model_len=config.max_model_len,
            )
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes is smaller than one block ({block_bytes} bytes)"
            )
        return int(num_blocks)

    def _eos_token_ids(self, path) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_config = path / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
        return ids

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
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if seq.status != SequenceStatus.FINISHED:
                self.scheduler.finish(seq)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        request.finished = True
        request.metrics.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            # Heartbeats report step times (router's TTFT prediction); every return path counts.
            self.last_step_s = time.perf_counter() - started

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for item in sched.scheduled:
            request = item.seq.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = item.seq.num_computed_tokens
        step_logits = self.runner.execute(sched.scheduled, self.kv.take_pending_copies())
        logits, sample_rows = step_logits.sample, step_logits.sample_rows
        if step_logits.prompt_rows:
            self._record_prompt_logprobs(sched.scheduled, step_logits)

        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += item.num_new_tokens

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
            return []
        if row_logits != list(range(len(row_logits))):
            logits = logits[row_logits]
        rows = [
            SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, seq.generator) for seq in row_seqs
        ]
        tokens, logprobs = self.sampler(logits, rows)

        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, token, position_logprobs in zip(row_seqs, tokens, logprobs, strict=True):
            self._append_token(seq, token, position_logprobs)
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            touched[request.request_id] = request
            if seq.is_finished:
                self.scheduler.finish(seq)
        self.num_generated_tokens += len(tokens)

        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished:
                request.finished = True
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self._request_output(request, finished))
        return outputs

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSeq], step_logits: StepLogits) -> None:
        # A recomputed prompt (after preemption) writes the same values again.
        all_logprobs = torch.log_softmax(step_logits.prompt, dim=1)
        offset = 0
        for rows in step_logits.prompt_rows:
            seq = scheduled[rows.sched_index].seq
            request = seq.request
            for k in range(rows.count):
                token_index = rows.first_token + k
                request.prompt_logprobs[token_index] = self.sampler.position_logprobs(
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
            request.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        parent.fork_into = 1
        return children

    def _append_token(self, seq: Sequence, token: int, position_logprobs) -> None:
        params = seq.params
        seq.token_ids.append(token)
        if position_logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(position_logprobs)
        piece = detokenize_incrementally(self.tokenizer, seq)
        num_output = seq.num_output_tokens
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
        if num_output >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    # The server sets this: each output then carries only what is new since the request's
    # previous one (no per-step copy of the whole text, token ids and logprobs).
    output_deltas = False

    def _request_output(self, request: Request, finished: bool) -> RequestOutput:
        if self.output_deltas:
            return self._delta_output(request, finished)
        completions = [
            CompletionOutput(
                index=seq.index,
                text=visible_text(seq),
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            )
            for seq in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=replace(request.metrics),  # a snapshot: the live one moves on with the request
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )

    def _delta_output(self, request: Request, finished: bool) -> RequestOutput:
        completions = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            text_end = max(visible_text_len(seq), seq.sent_text)
            num_output = seq.num_output_tokens
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.text[seq.sent_text : text_end],
                token_ids=seq.token_ids[seq.num_prompt_tokens + seq.sent_tokens :],
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs[seq.sent_tokens :] if seq.logprobs is not None else None,
            ))
            seq.sent_text, seq.sent_tokens = text_end, num_output
        # The prompt's logprobs are complete once it has been prefilled: send them once.
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=replace(request.metrics),
            prompt_logprobs=prompt_logprobs,
        )

    # --- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        running_requests = {seq.request.request_id for seq in sched.running}
        waiting_requests = {seq.request.request_id for seq in sched.waiting} - running_requests
        # For the router's TTFT prediction: prompt work queued here, and how many sequences decode.
        # A waiting prompt's cached prefix costs nothing: count what admission would still compute.
        prefill_pending = 0
        for seq in sched.waiting:
            cached = len(self.kv.find_cached_prefix(seq)) * self.block_size if not seq.block_table else 0
            prefill_pending += seq.num_tokens - max(seq.num_computed_tokens, cached)
        num_decoding = 0
        for seq in sched.running:
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1:
                prefill_pending += left
            else:
                num_decoding += 1
        return EngineStats(
            num_running=len(running_requests),
            num_waiting=len(waiting_requests),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_active=self.pool.num_active_blocks,
            kv_blocks_cached=self.pool.num_cached_free_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            extra={
                "generation_tokens_total": float(self.num_generated_tokens),
                "prompt_tokens_computed_total": float(self.num_prompt_tokens_computed),
                "prefill_tokens_waiting": float(prefill_pending),
                "last_step_s": self.last_step_s,
                "max_num_batched_tokens": float(self.scheduler.max_num_batched_tokens),
                "num_decoding": float(num_decoding),
                "kv_blocks_evicted_total": float(self.pool.num_evicted),
                "enable_prefix_caching": float(self.kv.enable_prefix_caching),
            },
        )

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def cached_block_hashes(self) -> list[int]:
        return self.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
