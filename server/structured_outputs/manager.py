"""The engine's side of structured outputs: requests waiting for grammars, a matcher per
sequence, and the batch bitmask applied to the logits each step.

The engine calls, in step order: ``poll`` (grammars ready or failed: ready requests go to the
scheduler, failed ones end with an error before any token), ``start_masks`` (before the forward
pass: the scheduled sequences' masks are filled on a thread while the forward runs, since a
matcher's state depends only on the tokens already accepted), ``apply`` (after the forward pass,
before penalties and sampling: every constrained row's disallowed tokens to -inf, in place, from
the masks filled early, or filled now for a row that was not foreseen, as a fork's),
``accept`` (each sampled token advances its matcher; a complete grammar ends the sequence),
``forced_tokens`` (fast-forward: what the grammar allows as the only continuation after that
token, which the engine appends without sampling), ``fork`` (n > 1: each sample its own copy of
the matcher) and ``release`` (finished or aborted). Preemption by recompute needs nothing: a
preempted sequence keeps its generated tokens and only recomputes their KV, so its matcher is
already where it should be.

Fast-forward: the engine appends the forced run to the sequence (each token through the same
end-of-sequence checks as a sampled one: max_tokens, stop strings, stop ids) and the next step
computes the run's KV and the following logits as one multi-token chunk, as chunked prefill
does. The grammar alone decides what is forced; ``fast_forward_allowed`` decides for whom.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvscale.kernels import cpu_native
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.compiler import (
    GrammarCompiler,
    GrammarFailure,
    PendingGrammar,
    StructuredOutputsConfig,
)

logger = logging.getLogger(__name__)


@dataclass
class GrammarStats:
    """Cumulative figures for /metrics (EngineStats.extra)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    failures: int = 0
    timeouts: int = 0  # over the CPU-time limit
    wait_timeouts: int = 0  # waited past the wall-clock bound (a starved or queued compile)
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0  # filling masks (mostly hidden behind the forward pass)
    forced_tokens: int = 0  # appended by fast-forward, without a sampling step each


def fast_forward_allowed(params: SamplingParams) -> bool:
    """Whether a request's forced tokens may skip sampling. Not with ``logprobs``: a forced token
    has no logprob without the forward pass it skips. Not with ``logit_bias``: the client may have
    banned a token the grammar's canonical tokenization would force, which sampling respects (it
    picks another tokenization of the same text)."""
    return params.logprobs is None and not params.logit_bias


def forced_run(forced: list[int], stop_token_ids: frozenset[int] | list[int], eos_token_ids: set[int]) -> list[int]:
    """The part of a forced run to append: up to, not including, the first stop or end-of-sequence
    id, which is left to a sampling step (min_tokens masks those; a sampled one ends the answer)."""
    for i, token in enumerate(forced):
        if token in eos_token_ids or token in stop_token_ids:
            return forced[:i]
    return forced


def unpack(bitmask: torch.Tensor) -> np.ndarray:
    """The int32 bitmask (rows x words, bit j of word w = token 32w + j) as 0/1 bytes (rows x 32 words)."""
    # numpy's unpackbits is many times faster than shifting in torch (x86: little-endian words).
    return np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")


def mask_rows_inplace(logits: np.ndarray, bits: np.ndarray) -> None:
    """-inf wherever ``bits`` is 0. Each row touches only the smaller side: inside a JSON string
    nearly every token is allowed, between keys only a handful, so either way it is little work."""
    vocab = logits.shape[1]
    for j in range(logits.shape[0]):
        row_bits = bits[j, :vocab]
        row = logits[j]
        if int(np.count_nonzero(row_bits)) * 2 < vocab:
            keep = np.flatnonzero(row_bits)
            values = row[keep]
            row.fill(-np.inf)
            row[keep] = values
        else:
            row[np.flatnonzero(row_bits == 0)] = -np.inf


def _apply_unpacked(logits: torch.Tensor, rows: list[int], bits: np.ndarray) -> None:
    """The PyTorch path of ``apply`` (a GPU's logits, or no C kernels): 0/1 bytes per token."""
    vocab = logits.shape[1]
    if vocab > bits.shape[1]:  # ids the tokenizer does not know: never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        mask_rows_inplace(sub.numpy(), bits)
    else:
        allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_)).to(logits.device)
        sub.masked_fill_(allowed.logical_not(), float("-inf"))
    logits.index_copy_(0, index, sub)


@dataclass
class EarlyMasks:
    """The masks of one step's sequences, being filled on the mask thread during the forward pass."""

    seq_ids: list[int]
    bitmask: torch.Tensor  # row k: seq_ids[k]
    fill_seconds: Future[float]


def _fill_timed(matchers: list[backend.Matcher], bitmask: torch.Tensor, executor: Any | None) -> float:
    started = time.perf_counter()
    backend.fill_bitmasks(matchers, bitmask, executor)
    return time.perf_counter() - started


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 config: StructuredOutputsConfig | None = None) -> None:
        self.config = config or StructuredOutputsConfig()
        self.compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids, self.config)
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self.pending: dict[str, tuple[Request, PendingGrammar]] = {}
        self.matchers: dict[int, backend.Matcher] = {}  # seq_id -> matcher
        self.executor = backend.make_executor(self.config.mask_threads)
        # One thread: it only waits on the library, which fills rows on its own threads.
        self.mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kvscale-masks")
        self.early: EarlyMasks | None = None
        self.stats = GrammarStats()

    # --- requests waiting for their grammar ---------------------------------------------
    def submit(self, request: Request) -> None:
        spec = request.params.structured_outputs
        assert spec is not None
        self.pending[request.request_id] = (request, self.compiler.submit(spec))

    def has_pending(self) -> bool:
        return bool(self.pending)

    def poll(self) -> tuple[list[Request], list[tuple[Request, GrammarFailure]]]:
        """Requests whose grammar is ready (each sequence now has its matcher), and requests whose
        grammar failed, with why (the message their client gets)."""
        ready: list[Request] = []
        failed: list[tuple[Request, GrammarFailure]] = []
        if not self.pending:
            return ready, failed
        now = time.monotonic()
        for request_id, (request, pending) in list(self.pending.items()):
            result = pending.poll(now, self.config)
            if result is None:
                continue
            del self.pending[request_id]
            if isinstance(result, GrammarFailure):
                self.stats.failures += 1
                self.stats.timeouts += result.reason == "timeout"
                self.stats.wait_timeouts += result.reason == "wait_timeout"
                failed.append((request, result))
                continue
            self.stats.compiles += 1
            self.stats.compile_seconds += result.seconds
            request.metrics.grammar_compile_s = result.seconds
            request.metrics.grammar_cache_hit = pending.cache_hit
            for seq in request.seqs:
                self.matchers[seq.seq_id] = backend.Matcher.of(result.template)
            ready.append(request)
        return ready, failed

    def forward_running(self) -> AbstractContextManager[None]:
        """A forward pass runs inside this block: low-priority compiles wait for it (compile_pool.py)."""
        return self.compiler.pool.forward_running()

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for any pending compile (when there is nothing else to run)."""
        futures = [pending.future for _, pending in self.pending.values()]
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # --- the step -----------------------------------------------------------------------
    def start_masks(self, seqs: list[Sequence]) -> None:
        """Start filling the masks of ``seqs`` (those of a step that may sample) on the mask thread,
        so that the forward pass hides the fill; ``apply`` collects them."""
        self._settle()
        constrained = [seq for seq in seqs if seq.seq_id in self.matchers]
        if not constrained:
            return
        bitmask = torch.empty((len(constrained), self.words), dtype=torch.int32)
        matchers = [self.matchers[seq.seq_id] for seq in constrained]
        self.early = EarlyMasks([seq.seq_id for seq in constrained], bitmask,
                                self.mask_thread.submit(_fill_timed, matchers, bitmask, self.executor))

    def _settle(self) -> EarlyMasks | None:
        """Wait for the early fill, if one runs (nothing may advance, copy or drop a matcher while
        the mask thread reads it), and hand it over."""
        early, self.early = self.early, None
        if early is not None:
            self.stats.mask_seconds += early.fill_seconds.result()
        return early

    def _bitmask(self, seqs: list[Sequence]) -> torch.Tensor:
        """Row i: the mask of seqs[i], from the early fill where it has it, else filled now."""
        early = self._settle()
        ids = [seq.seq_id for seq in seqs]
        if early is not None and early.seq_ids == ids:
            return early.bitmask
        bitmask = torch.empty((len(seqs), self.words), dtype=torch.int32)
        filled = {seq_id: k for k, seq_id in enumerate(early.seq_ids)} if early is not None else {}
        have = [(i, filled[seq_id]) for i, seq_id in enumerate(ids) if seq_id in filled]
        if have and early is not None:
            bitmask[[i for i, _ in have]] = early.bitmask[[k for _, k in have]]
        missing = [i for i, seq_id in enumerate(ids) if seq_id not in filled]
        if missing:
            rows = torch.empty((len(missing), self.words), dtype=torch.int32)
            self.stats.mask_seconds += _fill_timed([self.matchers[ids[i]] for i in missing], rows, self.executor)
            bitmask[missing] = rows
        return bitmask

    def apply(self, logits: torch.Tensor, row_seqs: list[Sequence]) -> None:
        """Mask every constrained row of ``logits`` (one row per entry of ``row_seqs``) in place."""
        rows = [i for i, seq in enumerate(row_seqs) if seq.seq_id in self.matchers]
        if not rows:
            self._settle()
            return
        bitmask = self._bitmask([row_seqs[i] for i in rows])
        # The logits come out of the forward pass as inference tensors.
        with torch.inference_mode():
            if not cpu_native.apply_token_bitmask(logits, rows, bitmask):
                _apply_unpacked(logits, rows, unpack(bitmask))
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance ``seq``'s matcher by its sampled token; True when the grammar is now complete
        (or, which the mask should rule out, the token broke it: the sequence ends either way)."""
        self._settle()
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            return False
        if not matcher.consume(token):
            logger.error("request %s: the grammar rejected a sampled token (%s)",
                         seq.request.request_id, matcher.error())
            return True
        return matcher.is_stopped()

    def forced_tokens(self, seq: Sequence) -> list[int]:
        """The tokens ``seq``'s grammar forces next (empty when fast-forward is off, the request
        is unconstrained or not allowed it, or the next token is a real choice)."""
        if not self.config.fast_forward:
            return []
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None or not fast_forward_allowed(seq.params):
            return []
        return forced_run(matcher.forced_tokens(), seq.params.stop_token_set, self.eos_token_ids)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._settle()
        matcher = self.matchers.get(parent.seq_id)
        if matcher is not None:
            self.matchers[child.seq_id] = matcher.copy()

    def release(self, request: Request) -> None:
        self._settle()
        self.pending.pop(request.request_id, None)
        for seq in request.seqs:
            self.matchers.pop(seq.seq_id, None)

    def extra_stats(self) -> dict[str, float]:
        s = self.stats
        return {
            "structured_compiles_total": float(s.compiles),
            "structured_compile_seconds_total": s.compile_seconds,
            "structured_compile_cache_hits_total": float(self.compiler.cache_hits),
            "structured_compile_failures_total": float(s.failures),
            "structured_compile_timeouts_total": float(s.timeouts),
            "structured_compile_wait_timeouts_total": float(s.wait_timeouts),
            "structured_mask_steps_total": float(s.mask_steps),
            "structured_mask_seconds_total": s.mask_seconds,
            "structured_forced_tokens_total": float(s.forced_tokens),
            "structured_waiting_for_grammar": float(len(self.pending)),
        }

    def shutdown(self) -> None:
        self._settle()
        self.mask_thread.shutdown()
        self.compiler.shutdown()
