"""Compiling grammars off the step loop: a bounded thread pool, a cache, a time limit.

A request whose grammar is compiling waits here, not in the scheduler; every other request keeps
decoding (the library releases the GIL while it builds a lexer). The cache is keyed by the
constraint's kind and canonical text (a JSON schema is serialized with sorted keys); the tokenizer
is fixed per compiler (one per engine), so it needs no place in the key. Identical requests that
arrive while the first is compiling share its future. A compile that outlives the time limit
fails its requests with a message naming the limit; it still finishes in the background and lands
in the cache, so a retry is served at once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 512


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config`` (vLLM's flag; JSON)."""

    backend: str = "guidance"
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    compile_workers: int = 1
    mask_threads: int = 1  # >1: the batch bitmask is filled by the library's threads
    cache_size: int = DEFAULT_CACHE_SIZE
    # Append the tokens the grammar forces (keys, punctuation) without a sampling step each; the
    # next step computes their KV as one chunk (manager.py, docs/server.md). On by default: it
    # gained on the shared sample's schemas (docs/benchmarks.md, bench/structured_fast_forward.py).
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("guidance", "llguidance", "auto"):
            raise ValueError(
                f"structured outputs backend {self.backend!r} is not available: kvscale enforces "
                "grammars with llguidance ('guidance'); see docs/server.md for why not xgrammar")
        if not self.compile_timeout_s > 0:
            raise ValueError("compile_timeout_s must be positive")
        if self.compile_workers < 1 or self.mask_threads < 1 or self.cache_size < 0:
            raise ValueError("compile_workers and mask_threads must be at least 1, cache_size non-negative")
        if not isinstance(self.fast_forward, bool):
            raise ValueError("fast_forward must be true or false")


@dataclass
class Compiled:
    template: Any  # the library's pristine matcher
    seconds: float  # how long the compile took (0 for a cache hit)


def cache_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    kind = spec.kind
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        assert spec.choice is not None
        return kind, "\x00".join(spec.choice)
    return kind, str(getattr(spec, kind))


class _Job:
    """A compile in the pool; ``started`` is set when a worker picks it up (the time limit counts
    compile time, not time queued behind other compiles)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.future: Future = Future()


class PendingGrammar:
    """One request's wait for its grammar."""

    def __init__(self, job: _Job, cache_hit: bool) -> None:
        self.job = job
        self.future = job.future
        self.cache_hit = cache_hit
        self.timed_out = False  # poll() answered with the time limit's message

    def poll(self, now: float, timeout_s: float) -> Compiled | str | None:
        """The compiled grammar, an error message, or None while still compiling."""
        if self.future.done():
            exc = self.future.exception()
            if exc is None:
                result: Compiled = self.future.result()
                if self.cache_hit:
                    return Compiled(result.template, 0.0)
                # Looked at only after it finished (one engine step can outlast a compile under
                # load): the limit holds all the same, else it would depend on the step's length.
                # The grammar stays cached: the retry is served at once.
                if result.seconds >= timeout_s:
                    return self._over_limit(timeout_s)
                return result
            if isinstance(exc, backend.GrammarError):
                return f"This request's grammar cannot be enforced: {exc}"
            return f"Compiling this request's grammar failed: {type(exc).__name__}: {exc}"
        started = self.job.started
        if started is not None and now - started >= timeout_s:
            return self._over_limit(timeout_s)
        return None

    def _over_limit(self, timeout_s: float) -> str:
        self.timed_out = True
        return (f"Compiling this request's grammar took longer than the limit of {timeout_s:g} s "
                "(--structured-outputs-config compile_timeout_s).")


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 config: StructuredOutputsConfig) -> None:
        self.config = config
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = set(eos_token_ids)
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.compile_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Job] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0

    def tokenizer(self) -> Any:
        """Built on first use, in a compile worker, so neither startup nor a step pays for it."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = backend.build_tokenizer(self._hf_tokenizer, self._vocab_size,
                                                          self._eos_token_ids)
            return self._tokenizer

    def submit(self, spec: StructuredOutputsParams) -> PendingGrammar:
        key = cache_key(spec)
        with self._lock:
            job = self._cache.get(key)
            # A failed compile is not cached: the error may have been the time limit's.
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return PendingGrammar(job, cache_hit=job.future.done())
            self.cache_misses += 1
            job = _Job()
            self._pool.submit(self._compile, spec, job)
            if self.config.cache_size:
                self._cache[key] = job
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return PendingGrammar(job, cache_hit=False)

    def _compile(self, spec: StructuredOutputsParams, job: _Job) -> None:
        try:
            tokenizer = self.tokenizer()
            job.started = time.monotonic()
            started = time.perf_counter()
            template = backend.compile_grammar(tokenizer, backend.grammar_text(spec))
            job.future.set_result(Compiled(template, time.perf_counter() - started))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
            job.future.set_exception(exc)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
