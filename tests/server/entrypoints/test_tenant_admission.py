"""The router's tenant header on a replica (docs/server.md, "Tenants"): behind the replica's key
a freed slot goes to the tenant holding fewest; without a key the header is ignored. A real
engine on a thread of this process behind the real app and uvicorn."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import serve_app_in_thread  # noqa: E402
from thread_engine import ThreadEngine  # noqa: E402

from kvscale.model_files import load_tokenizer
from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.entrypoints.api_server import build_app
from kvscale.server.entrypoints.tenant_header import MAX_TENANT_CHARS, tenant_of
from kvscale.tenant_limits_schema import TENANT_HEADER

pytestmark = pytest.mark.slow

KEY = "sk-replicas"


def test_the_header_is_read_bounded() -> None:
    header = TENANT_HEADER.encode()
    assert tenant_of([(b"host", b"x"), (header, b"team-a"), (header, b"team-b")]) == "team-a"
    assert tenant_of([(b"host", b"x")]) == ""
    assert tenant_of([(header, b"  ")]) == ""
    assert tenant_of([(header, b"a" * MAX_TENANT_CHARS)]) == "a" * MAX_TENANT_CHARS
    assert tenant_of([(header, b"a" * (MAX_TENANT_CHARS + 1))]) == ""
    assert tenant_of([(header, b"a\x07b")]) == ""


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    # Two sequences at a time: two running blockers hold every later request in the queue; they
    # may run for many seconds (they are cut short), so nothing ends before the test says.
    yield LLMEngine(EngineConfig(max_model_len=2048, num_gpu_blocks_override=272, max_num_seqs=2,
                                 device="cpu"))


def serve(engine: LLMEngine, api_key: str | None) -> tuple[uvicorn.Server, threading.Thread, str]:
    app = build_app(ThreadEngine(engine), tokenizer=load_tokenizer(engine.model_path),
                    served_model_names=[engine.model_name], max_model_len=engine.max_model_len,
                    api_key=api_key)
    return serve_app_in_thread(app)


def finish_order(engine: LLMEngine, api_key: str | None) -> list[str]:
    """A heavy tenant's two blockers run; three more of its requests and then a light tenant's
    one queue behind them, in that order; one blocker is then cut short, which frees one slot.
    The order the four finish in (the other blocker still holds the other slot)."""
    server, thread, base = serve(engine, api_key)
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def body(max_tokens: int) -> dict:
        return {"prompt": "Count: one, two,", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}

    async def scenario() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async def one(name: str, tenant: str) -> None:
                response = await http.post("/v1/completions", json=body(2),
                                           headers={**auth, TENANT_HEADER: tenant})
                assert response.status_code == 200, response.text
                finished.append(name)

            async def waiting(count: int) -> None:
                while len(engine.scheduler.waiting) < count:
                    await asyncio.sleep(0.01)

            blocker = {**body(2000), "stream": True}
            heavy = {**auth, TENANT_HEADER: "heavy"}
            async with http.stream("POST", "/v1/completions", json=blocker, headers=heavy) as other:
                # Running once its first token came. The line iterators are kept: one collected
                # would close its response, which aborts that request.
                other_lines = other.aiter_lines()
                await anext(other_lines)
                async with http.stream("POST", "/v1/completions", json=blocker, headers=heavy) as cut:
                    cut_lines = cut.aiter_lines()
                    await anext(cut_lines)
                    tasks = []
                    for count, (name, tenant) in enumerate(
                            [("h1", "heavy"), ("h2", "heavy"), ("h3", "heavy"), ("l1", "light")], 1):
                        tasks.append(asyncio.create_task(one(name, tenant)))
                        await asyncio.wait_for(waiting(count), 30)  # queued in this order
                    assert len(engine.scheduler.running) == 2, "a blocker ended too soon"
                # Leaving the stream disconnects that blocker: it is aborted, a slot freed.
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
                assert len(engine.scheduler.running) == 1, "the other blocker ended too soon"
                del other_lines, cut_lines
        return finished

    try:
        return asyncio.run(scenario())
    finally:
        server.should_exit = True
        thread.join(30)


def test_behind_the_key_the_tenants_take_turns(engine) -> None:
    # The light tenant holds no slot, the heavy one holds one: the light request goes first.
    assert finish_order(engine, KEY) == ["l1", "h1", "h2", "h3"]


def test_without_a_key_the_header_is_ignored(engine) -> None:
    assert finish_order(engine, None) == ["h1", "h2", "h3", "l1"]
