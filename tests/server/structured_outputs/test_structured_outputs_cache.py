"""The compile cache and pool without a grammar library: keys that tell constraints apart, a
bound in bytes, and a compile past its CPU-time limit that gives its worker up (a fake compile
stands in for the library, so these take well under a second)."""

from __future__ import annotations

import threading
import time

import pytest

from kvscale.server.config import StructuredOutputsConfig
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import compile_pool
from kvscale.server.structured_outputs import compiler as compiler_module
from kvscale.server.structured_outputs.compiler import (
    GrammarCompiler,
    GrammarFailure,
    cache_key,
    compiled_bytes,
)

LIMIT = StructuredOutputsConfig(compile_timeout_s=0.1, compile_wait_timeout_s=30, compile_priority="normal")


def test_the_cache_key_tells_every_two_constraints_apart() -> None:
    specs = [StructuredOutputsParams(choice=["a\0b"]), StructuredOutputsParams(choice=["a", "b"]),
             StructuredOutputsParams(choice=["a,b"]), StructuredOutputsParams(choice=['a","b']),
             StructuredOutputsParams(regex="a"), StructuredOutputsParams(grammar="a"),
             StructuredOutputsParams(json='{"type":"object"}'), StructuredOutputsParams(json_object=True),
             StructuredOutputsParams(json='{"type":"object"}', disable_additional_properties=True)]
    assert len({cache_key(spec) for spec in specs}) == len(specs)
    assert cache_key(StructuredOutputsParams(choice=["x", "y"])) == cache_key(StructuredOutputsParams(choice=["x", "y"]))


@pytest.fixture
def fake_library(monkeypatch):
    """Compiles take as long as ``hold`` says: ``slow`` spins on the CPU until released."""
    release = threading.Event()

    def compile_fn(_tokenizer, spec: StructuredOutputsParams) -> str:
        if (spec.regex or "").startswith("slow"):
            while not release.is_set():
                pass
        return f"grammar of {spec.kind}"

    monkeypatch.setattr(compiler_module, "_compile", compile_fn)
    monkeypatch.setattr(compiler_module.backend, "build_tokenizer", lambda *args: None)
    yield release
    release.set()


def test_the_cache_is_bounded_in_bytes(fake_library) -> None:
    sizes = [compiled_bytes(StructuredOutputsParams(regex="r" * n)) for n in (4000, 3000, 2000)]
    config = StructuredOutputsConfig(cache_bytes=sizes[0] + sizes[1], compile_priority="normal")
    compiler = GrammarCompiler(None, 8, {0}, config)
    try:
        for n in (4000, 3000, 2000):
            compiler.submit(StructuredOutputsParams(regex="r" * n)).future.result(timeout=10)
        assert compiler.cache_bytes == sizes[1] + sizes[2] <= config.cache_bytes  # the oldest went
        assert compiler.submit(StructuredOutputsParams(regex="r" * 2000)).cache_hit
        assert not compiler.submit(StructuredOutputsParams(regex="r" * 4000)).cache_hit
        huge = StructuredOutputsParams(regex="r" * 20000)  # alone over the bound: never kept
        compiler.submit(huge).future.result(timeout=10)
        assert compiler.cache_bytes <= config.cache_bytes and not compiler.submit(huge).cache_hit
    finally:
        compiler.shutdown()


def test_a_compile_past_its_cpu_limit_does_not_hold_the_worker(fake_library) -> None:
    """One worker; a client's slow schema runs past the limit: its request fails with the limit,
    and the next client's compile is served at once, not after the slow one."""
    compiler = GrammarCompiler(None, 8, {0}, LIMIT)
    try:
        slow = compiler.submit(StructuredOutputsParams(regex="slow"))
        deadline = time.monotonic() + 10
        while (answer := slow.poll(time.monotonic(), LIMIT)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(answer, GrammarFailure) and answer.reason == "timeout"
        other = compiler.submit(StructuredOutputsParams(regex="fast"))
        assert other.future.result(timeout=5).template == "grammar of regex"
        assert not slow.future.done()  # still compiling beside it
        fake_library.set()
        slow.future.result(timeout=5)
        deadline = time.monotonic() + 5
        while sum(t.is_alive() for t in compiler.pool.threads) > LIMIT.compile_workers:
            assert time.monotonic() < deadline, "the abandoned thread did not end"
            time.sleep(0.01)
    finally:
        compiler.shutdown()


def test_abandoned_compiles_are_bounded(fake_library, monkeypatch) -> None:
    """Past MAX_ABANDONED threads finishing slow compiles, the next slow one keeps its worker."""
    monkeypatch.setattr(compile_pool, "MAX_ABANDONED", 1)
    compiler = GrammarCompiler(None, 8, {0}, LIMIT)
    try:
        first = compiler.submit(StructuredOutputsParams(regex="slow 1"))
        second = compiler.submit(StructuredOutputsParams(regex="slow 2"))
        while not first.job.runs:
            time.sleep(0.01)
        assert compiler.pool.abandon(first.job) and not compiler.pool.abandon(first.job)
        while not second.job.runs:  # taken by the replacement
            time.sleep(0.01)
        assert not compiler.pool.abandon(second.job)
        assert sum(t.is_alive() for t in compiler.pool.threads) == 2
    finally:
        compiler.shutdown()
