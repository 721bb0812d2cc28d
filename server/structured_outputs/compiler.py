"""Compiling grammars off the step loop: a bounded pool of low-priority threads, a cache, two limits.

A request whose grammar is compiling waits here, not in the scheduler; every other request keeps
decoding (the library releases the GIL while it builds a lexer). The cache is keyed by the
constraint's kind and canonical text (a JSON schema is serialized with sorted keys); the tokenizer
is fixed per compiler (one per engine), so it needs no place in the key. Identical requests that
arrive while the first is compiling share its future.

Compile threads run at the lowest priority (``compile_priority``; compile_pool.py says why, and
how a pool starved while the engine is idle is rescued after ``compile_starved_after_s``): a
compile waits while the engine decodes. So the time limit (``compile_timeout_s``) counts the
compile's own CPU time, read from its thread's CPU clock: a compile is not failed for time the
scheduler never gave it. A second bound, in wall-clock time (``compile_wait_timeout_s``), caps
how long a request waits for its grammar, queue included; that request gets a 503 (the server is
busy, the schema is not at fault). A compile that outlives either limit fails its requests; it still finishes in the
background and lands in the cache, so a retry is served at once. One found running past the CPU-time
limit gives its worker up (compile_pool.py, ``abandon``): a new worker takes the queue, so a client's
slow schema fails its own requests and delays no one else's.

The cache's key is a SHA-256 digest of a canonical JSON encoding of the constraint (its kind, the
``strict`` flag, and its text or list of choices), so two constraints share an entry only when
they are the same. The cache is bounded in bytes (``cache_bytes``, an estimate of each compiled
grammar's memory from its constraint's size) as well as in entries (``cache_size``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscale.server.config import StructuredOutputsConfig
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.compile_pool import Compiled, CompileJob, CompilePool

__all__ = ["Compiled", "GrammarCompiler", "GrammarFailure", "PendingGrammar", "StructuredOutputsConfig"]

@dataclass(frozen=True)
class GrammarFailure:
    """Why a request gets no grammar: ``reason`` is "unsupported" (the library refused or failed
    on it: a 400), "timeout" (over the CPU-time limit: a 400) or "wait_timeout" (waited past the
    wall-clock bound: a 503); ``message`` is what its client reads."""

    reason: str
    message: str


# A compiled grammar's memory per byte of its constraint, and at the least (llguidance 1.9 on
# the bundled tokenizer: ~30 KB for a tiny schema, ~2.6 MB for a 43 KB one).
COMPILED_BYTES_PER_BYTE = 64
COMPILED_BYTES_MIN = 32 * 1024


def cache_key(spec: StructuredOutputsParams) -> bytes:
    """Equal only for the same constraint: a digest of one unambiguous encoding of it."""
    kind = spec.kind
    value = spec.choice if kind == "choice" else getattr(spec, kind)
    canonical = json.dumps([kind, spec.disable_additional_properties, value], ensure_ascii=False,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).digest()


def compiled_bytes(spec: StructuredOutputsParams) -> int:
    """What a compiled grammar is counted as in the cache's byte bound."""
    return max(COMPILED_BYTES_MIN, COMPILED_BYTES_PER_BYTE * spec.text_bytes())


class PendingGrammar:
    """One request's wait for its grammar."""

    def __init__(self, job: CompileJob, cache_hit: bool,
                 on_over_limit: Callable[[CompileJob], object] | None = None) -> None:
        self.job = job
        self._on_over_limit = on_over_limit  # the pool's abandon: the worker goes back to the queue
        self.future = job.future
        self.cache_hit = cache_hit
        self.submitted = time.monotonic()  # the wait bound counts from here, queue included

    def poll(self, now: float, config: StructuredOutputsConfig) -> Compiled | GrammarFailure | None:
        """The compiled grammar, why there is none, or None while still compiling."""
        running_cpu_s = self.job.cpu_seconds(now)
        if self.future.done():
            exc = self.future.exception()
            if exc is None:
                result: Compiled = self.future.result()
                if self.cache_hit:
                    return Compiled(result.template, 0.0)
                # Looked at only after it finished (one engine step can outlast a compile under
                # load): the limit holds all the same, else it would depend on the step's length.
                # The grammar stays cached: the retry is served at once.
                if result.cpu_seconds >= config.compile_timeout_s:
                    return self._over_limit(config.compile_timeout_s)
                # Done, so served even if this look came after the wait bound: no longer waiting.
                return result
            if isinstance(exc, backend.GrammarError):
                return GrammarFailure("unsupported", f"This request's grammar cannot be enforced: {exc}")
            return GrammarFailure("unsupported", f"Compiling this request's grammar failed: {type(exc).__name__}: {exc}")
        if running_cpu_s is not None and running_cpu_s >= config.compile_timeout_s:
            if self._on_over_limit is not None:
                self._on_over_limit(self.job)
            return self._over_limit(config.compile_timeout_s)
        if now - self.submitted >= config.compile_wait_timeout_s:
            return GrammarFailure("wait_timeout", (
                f"This request waited longer than the limit of {config.compile_wait_timeout_s:g} s for its "
                "grammar to compile (--structured-outputs-config compile_wait_timeout_s): the server's CPUs "
                "are busy. The compile goes on; a retry is served from the cache once it is done."))
        return None

    @staticmethod
    def _over_limit(timeout_s: float) -> GrammarFailure:
        return GrammarFailure("timeout", (
            f"Compiling this request's grammar took longer than the limit of {timeout_s:g} s of CPU time "
            "(--structured-outputs-config compile_timeout_s)."))


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 config: StructuredOutputsConfig) -> None:
        self.config = config
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = set(eos_token_ids)
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.pool = CompilePool(self.tokenizer, _compile, config.compile_workers, config.compile_priority,
                                config.compile_starved_after_s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[CompileJob, int]] = OrderedDict()  # key -> (job, bytes)
        self.cache_bytes = 0
        self.cache_hits = 0
        self.cache_misses = 0

    def tokenizer(self) -> Any:
        """Built once: by the engine core's warm-up, else for the first compile by the pool's
        prepare thread, at the engine's priority (compile_pool.py says why not in a worker)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = backend.build_tokenizer(self._hf_tokenizer, self._vocab_size,
                                                          self._eos_token_ids)
            return self._tokenizer

    def submit(self, spec: StructuredOutputsParams) -> PendingGrammar:
        key = cache_key(spec)
        with self._lock:
            entry = self._cache.get(key)
            job = entry[0] if entry is not None else None
            # A failed compile is not cached: the error may have been the time limit's.
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return PendingGrammar(job, job.future.done(), self.pool.abandon)
            self.cache_misses += 1
            job = self.pool.submit(spec)
            self._remember(key, job, compiled_bytes(spec))
        return PendingGrammar(job, False, self.pool.abandon)

    def _remember(self, key: bytes, job: CompileJob, size: int) -> None:
        """Cache ``job`` within both bounds, the least recently used dropped first (under _lock)."""
        old = self._cache.pop(key, None)
        if old is not None:
            self.cache_bytes -= old[1]
        if not self.config.cache_size or size > self.config.cache_bytes:
            return
        self._cache[key] = (job, size)
        self.cache_bytes += size
        while len(self._cache) > self.config.cache_size or self.cache_bytes > self.config.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cache_bytes -= dropped

    def shutdown(self) -> None:
        self.pool.shutdown()


def _compile(tokenizer: Any, spec: StructuredOutputsParams) -> Any:
    return backend.compile_grammar(tokenizer, backend.grammar_text(spec))
