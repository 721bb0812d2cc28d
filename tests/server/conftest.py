"""Shared fixtures for the engine tests: the bundled model (converted once), a transformers
reference, and engines that are checked for leaked KV blocks when each test ends."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from bench.common import GREEDY_PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # The suite shares a 2-core machine with its own server subprocesses (and, in development,
    # with other runs): two spinning OpenMP threads per process then cost far more than they
    # give. KVSCALE_TEST_THREADS overrides.
    import torch

    torch.set_num_threads(int(os.environ.get("KVSCALE_TEST_THREADS", "1")))

GREEDY_NEW_TOKENS = 16


@pytest.fixture(scope="session")
def bundled_model_path():
    from kvscale.model_files import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_model_path):
    from kvscale.model_files import load_tokenizer

    return load_tokenizer(bundled_model_path)


@pytest.fixture(scope="session")
def hf_bundled_model(bundled_model_path):
    """The same checkpoint loaded by transformers, float32: the reference for greedy outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(bundled_model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy_tokens(hf_bundled_model, bundled_tokenizer) -> dict[str, list[int]]:
    """prompt -> transformers' greedy continuation (GREEDY_NEW_TOKENS tokens, EOS allowed)."""
    import torch

    reference = {}
    with torch.inference_mode():
        for prompt in GREEDY_PROMPTS:
            ids = torch.tensor([bundled_tokenizer.encode(prompt)])
            out = hf_bundled_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_NEW_TOKENS,
                do_sample=False, pad_token_id=bundled_tokenizer.eos_token_id,
            )
            reference[prompt] = out[0, ids.shape[1] :].tolist()
    return reference


def assert_no_leak(engine) -> None:
    """Every block is free again and no request is left behind."""
    assert not engine.has_unfinished_requests(), sorted(engine.requests)
    assert engine.in_flight is None, "a queued step's tokens were never read"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    pool = engine.pool
    assert pool.num_active_blocks == 0, f"{pool.num_active_blocks} KV blocks leaked"
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    host = pool.host
    if host is not None:  # the second KV tier: every slot holds a findable block or is free
        assert host.num_releasing == 0, f"{host.num_releasing} host slots still wait for a copy"
        assert host.num_cached + host.num_free == host.num_slots, "host KV slots leaked"
        assert not pool.take_tier_copies(), "copies between the tiers left queued"


@pytest.fixture
def make_engine(bundled_model_path) -> Iterator[Callable[..., object]]:
    """Build LLMEngines on the bundled model (float32, CPU); each is leak-checked at teardown."""
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine

    engines = []

    def factory(**overrides):
        settings = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 256}
        settings.update(overrides)
        engine = LLMEngine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        assert_no_leak(engine)


def _run_to_completion(engine, max_steps: int = 100_000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished, "a request finished twice"
                finished[output.request_id] = output
    raise AssertionError("engine did not finish (deadlock?)")


@pytest.fixture(scope="session")
def run_to_completion():
    """Step an engine until idle; returns request id -> its final RequestOutput."""
    return _run_to_completion


@pytest.fixture(scope="session")
def greedy_prompts() -> list[str]:
    return list(GREEDY_PROMPTS)


@pytest.fixture
def one_thread_per_rank():
    """Tensor-parallel ranks take their thread count from this process: one each, so several
    ranks share the machine's 2 cores calmly."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
