"""The event loop and the engine thread must not share one tokenizer.

A fast (Rust) tokenizer guards itself with PyO3's runtime borrow flags: a call that reconfigures
it (truncation, padding, special-token splitting) while another thread is inside an encode raises
``RuntimeError: Already borrowed``. `kvscale serve` tokenizes prompts on the event loop while the
engine (now in its own process, the engine core) encodes and detokenizes, so each side needs its
own tokenizer object.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvscale.cli import build_parser
from kvscale.server.entrypoints import cli_serve

pytestmark = pytest.mark.slow

LONG_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 30


@pytest.fixture(scope="module")
def served():
    args = build_parser("serve").parse_args([
        "serve", "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "64",
        "--max-model-len", "512", "--max-num-seqs", "8",
    ])
    return cli_serve.build(args)


def test_http_side_and_engine_have_their_own_tokenizer(served) -> None:
    """The engine runs in the engine core process: its tokenizer cannot be the HTTP side's."""
    import os

    assert served.core.pid != os.getpid() and served.core.is_alive
    assert os.path.exists(f"/proc/{served.core.pid}")


def test_tokenizing_on_both_sides_at_once(served) -> None:
    """The engine thread generates (encoding and detokenizing every step) while the event loop
    tokenizes prompts and chats and reconfigures its Rust tokenizer, as a truncating call does. Every
    request must succeed and the engine thread must live."""
    http_tokenizer = served.app.state.server.tokenizer

    async def scenario() -> list[int]:
        app = served.app
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as client:
                async def generate(i: int) -> int:
                    response = await client.post("/v1/completions", json={
                        "prompt": f"{i}: {LONG_TEXT[:200]}", "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True})
                    return response.status_code

                async def tokenize(i: int) -> int:
                    body = ({"prompt": LONG_TEXT} if i % 2 else
                            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONG_TEXT}]}]})
                    response = await client.post("/tokenize", json=body)
                    # What a truncating call does underneath (transformers sets it on its Rust
                    # tokenizer per call): reconfigure the HTTP side's tokenizer and put it back.
                    http_tokenizer.backend_tokenizer.enable_truncation(16)
                    http_tokenizer.backend_tokenizer.no_truncation()
                    return response.status_code

                generations = [asyncio.ensure_future(generate(i)) for i in range(6)]
                statuses = []
                deadline = time.monotonic() + 60
                i = 0
                while not all(g.done() for g in generations) and time.monotonic() < deadline:
                    statuses.append(await tokenize(i))
                    i += 1
                    await asyncio.sleep(0)
                statuses += await asyncio.gather(*generations)
                return statuses

    statuses = asyncio.run(scenario())
    assert served.core.error is None, served.core.error
    assert statuses and set(statuses) == {200}, statuses
