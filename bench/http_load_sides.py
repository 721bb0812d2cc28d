"""What one side of bench.http_load runs: the W1-like workload of random token-id prompts, the
offline engine's closed loop, and the OpenAI client's streams against a server."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from bench.http_servers import Server
from bench.stats import summary


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int, vocab_size: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_len))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def load_offline_engine(engine_flags: dict):
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_flags))


def run_offline(engine, workload: Workload, concurrency: int, round_id: int, temperature: float) -> dict:
    from kvscale.server.sampling_params import SamplingParams

    # Warm-up (first-call allocations), as the servers get one before their measured run.
    engine.add_request("warmup", workload.prompts[0][:16], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    next_index = 0
    starts: dict[str, float] = {}
    ttfts: list[float] = []
    seen_first: set[str] = set()
    total_tokens = 0

    def submit() -> None:
        nonlocal next_index
        i = next_index
        next_index += 1
        params = SamplingParams(max_tokens=workload.output_lens[i], ignore_eos=True, temperature=temperature,
                                seed=i if temperature > 0 else None)
        engine.add_request(f"r{i}-{round_id}", workload.prompts[i], params)
        starts[f"r{i}-{round_id}"] = time.perf_counter()

    start = time.perf_counter()
    while next_index < min(concurrency, len(workload.prompts)):
        submit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id not in seen_first and output.outputs[0].token_ids:
                seen_first.add(output.request_id)
                ttfts.append(now - starts[output.request_id])
            if output.finished:
                total_tokens += len(output.outputs[0].token_ids)
                if next_index < len(workload.prompts):
                    submit()
    elapsed = time.perf_counter() - start
    return {"output_tokens": total_tokens, "seconds": elapsed, "output_tokens_per_s": total_tokens / elapsed,
            "ttft_s": summary(ttfts)}


async def run_http(server: Server, workload: Workload, concurrency: int, temperature: float) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=3600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)))
    # Warm-up request, then the measured run.
    await client.completions.create(model=server.model, prompt=workload.prompts[0][:16], max_tokens=2,
                                    extra_body={"ignore_eos": True})

    ttfts: list[float] = []
    itls: list[float] = []
    counts: list[int] = []
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with semaphore:
            sent = time.perf_counter()
            last = None
            stream = await client.completions.create(
                model=server.model, prompt=workload.prompts[i], max_tokens=workload.output_lens[i],
                temperature=temperature, seed=i if temperature > 0 else None, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    counts.append(chunk.usage.completion_tokens)
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttfts.append(now - sent)
                    else:
                        itls.append(now - last)
                    last = now

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    elapsed = time.perf_counter() - start
    await client.close()
    if len(counts) != len(workload.prompts):
        raise RuntimeError(f"{server.name}: {len(counts)} of {len(workload.prompts)} streams reported usage")
    total = sum(counts)
    return {"output_tokens": total, "seconds": elapsed, "output_tokens_per_s": total / elapsed,
            "ttft_s": summary(ttfts), "itl_s": summary(itls)}
