"""W3 / W3-Zipf / W4's clients behind one router: closed loops of streamed requests (token-id
prompts, or conversations whose turns carry the answers), and one slice of a stream through one
policy's router with the replicas' cache counters around it (bench.w3_router)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

from bench.w3_fleet import MODEL, cache_counters
from bench.w3_workloads import conversation_messages, conversations, shared_prefix_prompts


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    started = time.perf_counter()
    first = None
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:
                continue  # a usage-only chunk
            choice = choices[0]
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            # A chat stream opens with a role-only chunk sent before any prefill: not a first token.
            if first is None and ("text" in choice or piece or choice.get("finish_reason")):
                first = time.perf_counter()
            if piece:
                text.append(piece)
                tokens += 1
        return {
            "ok": True,
            "ttft_s": (first or time.perf_counter()) - started,
            "latency_s": time.perf_counter() - started,
            "replica": response.headers.get("x-kvscale-replica"),
            "router_ms": float(response.headers.get("x-kvscale-router-ms", "nan")),
            "predicted_hit_tokens": int(response.headers.get("x-kvscale-predicted-hit-tokens", "0")),
            "text": "".join(text),
            "chunks": tokens,
        }


async def drive_prompts(router_url: str, prompts: list[list[int]], args, salt: str) -> tuple[list[dict], float]:
    """W3 / W3-Zipf: a closed loop of ``concurrency`` clients over token-id prompts."""
    concurrency = min(args.concurrency, len(prompts))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "cache_salt": salt}
                sent = time.perf_counter()
                result = await _stream(client, f"{router_url}/v1/completions", body)
                result["output_tokens"] = args.output_tokens
                result["sent_at"], result["prompt_ids"] = sent, prompt
                results.append(result)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


async def drive_chats(router_url: str, convs, args, salt: str) -> tuple[list[dict], float]:
    """W4: ``concurrency`` conversations at a time; each turn's prompt is the history plus a new message."""
    concurrency = min(args.concurrency, len(convs))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for conv in convs:
            queue.put_nowait(conv)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                answers: list[str] = []
                for turn in range(len(conv.questions)):
                    await asyncio.sleep(conv.think_s[turn])
                    body = {"model": MODEL, "messages": conversation_messages(conv, turn, answers),
                            "max_tokens": args.answer_tokens, "temperature": 0, "stream": True, "cache_salt": salt}
                    sent = time.perf_counter()
                    result = await _stream(client, f"{router_url}/v1/chat/completions", body)
                    result["turn"] = turn
                    result["sent_at"], result["messages"] = sent, body["messages"]
                    result["output_tokens"] = result.get("chunks", 0)
                    results.append(result)
                    if not result["ok"]:
                        break
                    answers.append(result["text"])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def workload_items(args, workload: str) -> list:
    """The run's whole stream: token-id prompts (W3, W3-Zipf) or conversations (W4)."""
    if workload == "w4":
        return conversations(args.seed, args.conversations, args.document_words, args.question_words,
                             (args.think_min_s, args.think_max_s))
    return [p for _, p in shared_prefix_prompts(args.seed, args.groups, args.prefix_tokens, args.requests,
                                                args.suffix_tokens, zipf=workload == "w3-zipf")]


def run_block(args, workload: str, policy: str, router_url: str, replica_urls: list[str], items: list) -> dict:
    """One slice of the stream through one policy's router; the policy's own cache_salt."""
    salt = f"{workload}-{policy}-{args.seed}"
    q0, h0 = cache_counters(replica_urls)
    since = time.time()
    load = os.getloadavg()[0]
    drive = drive_chats if workload == "w4" else drive_prompts
    results, wall = asyncio.run(drive(router_url, items, args, salt))
    q1, h1 = cache_counters(replica_urls)
    return {"results": results, "wall": wall, "queries": q1 - q0, "hits": h1 - h0, "window": (since, time.time()),
            "loadavg": (load, os.getloadavg()[0])}
