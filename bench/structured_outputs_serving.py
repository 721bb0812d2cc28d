"""Structured outputs while serving (the targets bench/structured_outputs.py does not measure), each
part selected by ``--parts``:

- ``ttft``: time to first token of a request whose schema is not in the compile cache ÷ the same
  request again (cached). Schemas of the shared sample (not BFCL), one request at a time, each
  prompt prefilled once beforehand so both requests find it cached and differ only by the compile.
- ``storm``: inter-token latency p99 of unconstrained streams while 20 distinct hard schemas
  compile ÷ the same streams alone, and ÷ the same streams beside the same 20 requests once their
  grammars are cached (that isolates the compile from the requests' own work). kvscale only.
- ``tools``: the sample's BFCL rows as tool calls in each mode (named ``tool_choice``,
  ``required``, ``auto``, ``required`` streamed, ``required`` with ``parallel_tool_calls: false``):
  valid calls (every call's arguments validate, named and non-parallel give exactly one call),
  violations (a call whose arguments do not validate, a wrong name, more calls than allowed),
  cuts by ``max_tokens``, text answers.

Both servers run with ``--enable-auto-tool-choice --tool-call-parser hermes`` (vLLM needs them for
any tool call); vLLM's CPU build runs the same parts but the storm after kvscale in the same
invocation (``--baselines vllm``).

kvscale against itself in the same run: ``--before-checkout PATH`` serves an earlier commit's
worktree first (say ``git worktree add --detach /tmp/kvscale-main main``), and
``--compile-priorities normal,nice,idle`` runs one kvscale side per compile-thread priority
(``--structured-outputs-config {"compile_priority": ...}``), in that order.

    flock /tmp/kvscale-bench.lock python -m bench.structured_outputs_serving --baselines vllm

Writes bench/results/structured_outputs_serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.before_after import add_before_checkout
from bench.common import REPO, RESULTS, git_commit, machine
from bench.http_servers import first_served, start_kvscale, start_vllm, stop
from bench.jsonschemabench import load_rows
from bench.roofline import cpu_isa
from bench.stats import quantile
from bench.structured_outputs import ENGINE_FLAGS, MODEL

TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOL_MODES = ("named", "required", "auto", "streamed", "single")
TARGET_TTFT_RATIO = 2.0  # uncached ÷ cached, at most
TARGET_ITL_RATIO = 1.1  # storm ÷ without, at most
TARGET_VALID_TOOL_CALLS = 0.85


def schema_prompt(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Write one JSON value that satisfies this JSON schema:\n"
                                        + json.dumps(schema)[:1500]}]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def first_token_s(http: httpx.AsyncClient, base_url: str, body: dict) -> tuple[int, float | None]:
    """(status, seconds to the first streamed chunk that carries text)."""
    started = time.perf_counter()
    async with http.stream("POST", f"{base_url}/v1/chat/completions",
                           json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                event = json.loads(line[6:])
                if "choices" not in event:
                    return 0, None  # refused inside a 200 stream (vLLM does, for schemas xgrammar rejects)
                delta = event["choices"]
                if delta and (delta[0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - started
        return 200, first


async def part_ttft(base_url: str, rows: list[dict], per_set: int) -> dict[str, Any]:
    taken: dict[str, int] = {}
    chosen = []
    for row in rows:
        if not row["set"].startswith("BFCL") and taken.get(row["set"], 0) < per_set:
            taken[row["set"]] = taken.get(row["set"], 0) + 1
            chosen.append(row)
    per_schema = []
    async with httpx.AsyncClient(timeout=600) as http:
        for row in chosen:
            messages = schema_prompt(row["schema"])
            # The prompt into the prefix cache first: both timed requests then prefill alike.
            warm = await http.post(f"{base_url}/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0})
            warm.raise_for_status()
            body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0,
                    "response_format": json_schema_format(row["schema"])}
            status, uncached = await first_token_s(http, base_url, body)
            if status != 200 or uncached is None:
                per_schema.append({"id": row["id"], "status": status})
                continue
            _, cached = await first_token_s(http, base_url, body)
            per_schema.append({"id": row["id"], "status": status, "uncached_s": uncached, "cached_s": cached})
    timed = [r for r in per_schema if r.get("cached_s") is not None]
    uncached_p50 = statistics.median(r["uncached_s"] for r in timed) if timed else 0.0
    cached_p50 = statistics.median(r["cached_s"] for r in timed) if timed else 0.0
    return {"schemas": len(chosen), "timed": len(timed), "refused": sum(r["status"] == 400 for r in per_schema),
            "refused_in_stream": sum(r["status"] == 0 for r in per_schema),
            "uncached_ttft_p50_s": uncached_p50, "cached_ttft_p50_s": cached_p50,
            "uncached_over_cached": uncached_p50 / cached_p50 if cached_p50 else None,
            "per_schema": per_schema}


def hard_schema(offset: int, branches: int) -> dict:
    """A schema llguidance takes a while over (``branches`` alternatives of 30 bounded integers);
    a distinct ``offset`` gives a distinct grammar, so nothing is served from the cache."""
    return {"anyOf": [{"type": "object", "properties": {
        f"k{j}": {"type": "integer", "minimum": j + offset, "maximum": j * 1000 + offset + 7}
        for j in range(i, i + 30)}, "required": [f"k{i}"]} for i in range(branches)]}


async def stream_gaps(http: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int,
                      arrivals: list[float]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "choices" not in event:
                    raise RuntimeError(f"stream failed: {line[:300]}")
                choices = event["choices"]
                if choices and choices[0].get("text"):
                    arrivals.append(time.perf_counter())


async def storm_phase(base_url: str, streams: int, stream_tokens: int, schemas: list[dict] | None,
                      storm_tokens: int) -> dict[str, Any]:
    """Unconstrained streams; once each has 8 tokens, the constrained ``schemas`` (if any) all at
    once. Gaps are counted from then until the last constrained request ends (alone: until the
    streams end)."""
    per_stream: list[list[float]] = [[] for _ in range(streams)]
    async with httpx.AsyncClient(timeout=900) as http:
        tasks = [asyncio.create_task(stream_gaps(http, base_url, f"Story {i}: once upon a time", stream_tokens, a))
                 for i, a in enumerate(per_stream)]
        while min(len(a) for a in per_stream) < 8:
            if any(t.done() for t in tasks):
                await asyncio.gather(*tasks)  # raises what failed
            await asyncio.sleep(0.01)
        # Encoded before the window: 20 bodies of ~190 KB take this client's event loop ~50 ms,
        # in which the streams' tokens would be timestamped late.
        bodies = [json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "JSON"}],
                              "max_tokens": storm_tokens, "temperature": 0,
                              "response_format": json_schema_format(schema)}).encode()
                  for schema in schemas or []]
        window_start = time.perf_counter()
        statuses: list[int] = []
        if bodies:
            async def constrained(body: bytes) -> None:
                response = await http.post(f"{base_url}/v1/chat/completions", content=body,
                                           headers={"content-type": "application/json"})
                statuses.append(response.status_code)

            await asyncio.gather(*(constrained(b) for b in bodies))
        window_end = time.perf_counter() if schemas else None
        await asyncio.gather(*tasks)
    if window_end is None:
        window_end = max(a[-1] for a in per_stream)
    gaps = [b - a for stream in per_stream for a, b in zip(stream, stream[1:], strict=False)
            if window_start <= b <= window_end]
    return {"window_s": window_end - window_start, "gaps": len(gaps), "statuses": statuses,
            "itl_p50_s": quantile(gaps, 0.5) if gaps else None, "itl_p99_s": quantile(gaps, 0.99) if gaps else None,
            "itl_max_s": max(gaps) if gaps else None, "gaps_s": gaps}


async def part_storm(base_url: str, rounds: int, streams: int, stream_tokens: int, branches: int,
                     storm_tokens: int) -> dict[str, Any]:
    phases: dict[str, list[dict]] = {"alone": [], "storm": [], "cached": []}
    for round_id in range(rounds):
        schemas = [hard_schema(1 + round_id * 100 + k, branches) for k in range(20)]
        phases["alone"].append(await storm_phase(base_url, streams, stream_tokens, None, storm_tokens))
        phases["storm"].append(await storm_phase(base_url, streams, stream_tokens, schemas, storm_tokens))
        phases["cached"].append(await storm_phase(base_url, streams, stream_tokens, schemas, storm_tokens))
    summary: dict[str, Any] = {}
    for name, runs in phases.items():
        gaps = [g for run in runs for g in run["gaps_s"]]
        summary[name] = {"gaps": len(gaps), "itl_p50_s": quantile(gaps, 0.5), "itl_p99_s": quantile(gaps, 0.99),
                         "itl_max_s": max(gaps), "window_s": [run["window_s"] for run in runs],
                         "statuses": [s for run in runs for s in run["statuses"]]}
    storm_p99 = summary["storm"]["itl_p99_s"]
    return {"rounds": rounds, "streams": streams, "stream_tokens": stream_tokens, "branches": branches,
            "storm_tokens": storm_tokens, **summary,
            "storm_over_alone_p50": summary["storm"]["itl_p50_s"] / summary["alone"]["itl_p50_s"],
            "storm_over_alone_p99": storm_p99 / summary["alone"]["itl_p99_s"],
            "storm_over_cached_p99": storm_p99 / summary["cached"]["itl_p99_s"],
            "runs": {name: [{k: v for k, v in run.items() if k != "gaps_s"} for run in runs]
                     for name, runs in phases.items()}}


def tool_cases(rows: list[dict], per_set: int) -> list[tuple[str, dict, list[dict]]]:
    """(row id, the tool, the conversation) for the first BFCL rows of each set; the user's
    question is written from the row's ground-truth call."""
    cases = []
    for set_name in ("BFCL_simple", "BFCL_parallel"):
        for row in [r for r in rows if r["set"] == set_name][:per_set]:
            (name, parameters), = row["schema"]["properties"].items()
            truth = next((t["data"][name] for t in row.get("tests") or [] if t["valid"]), {})
            ask = ", ".join(f"{key} {value}" for key, value in truth.items())
            tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
            cases.append((row["id"], tool, [{"role": "user", "content": f"Call {name} with {ask}."}]))
    return cases


def judge_calls(mode: str, tool: dict, finish: str | None, calls: list[dict]) -> dict[str, Any]:
    """``calls``: [{"name", "arguments"}]. A cut answer is "length" whatever it holds."""
    if finish == "length":
        return {"outcome": "length"}
    if not calls:
        return {"outcome": "text", "finish": finish}
    if mode in ("named", "single") and len(calls) != 1:
        return {"outcome": "violation", "why": f"{len(calls)} calls"}
    for call in calls:
        if call["name"] != tool["function"]["name"]:
            return {"outcome": "violation", "why": f"name {call['name']!r}"}
        try:
            jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            return {"outcome": "violation", "why": str(exc)[:200], "arguments": call["arguments"][:200]}
    return {"outcome": "valid", "finish": finish, "calls": len(calls)}


async def one_tool_request(http: httpx.AsyncClient, base_url: str, mode: str, tool: dict, messages: list[dict],
                           max_tokens: int) -> dict[str, Any]:
    choice: Any = {"named": {"type": "function", "function": {"name": tool["function"]["name"]}},
                   "auto": "auto"}.get(mode, "required")
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": [tool], "tool_choice": choice,
                            "max_tokens": max_tokens, "temperature": 0}
    if mode == "single":
        body["parallel_tool_calls"] = False
    url = f"{base_url}/v1/chat/completions"
    if mode != "streamed":
        response = await http.post(url, json=body)
        if response.status_code != 200:
            return {"outcome": f"http_{response.status_code}", "message": response.text[:200]}
        answer = response.json()["choices"][0]
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in answer["message"].get("tool_calls") or []]
        return {**judge_calls(mode, tool, answer["finish_reason"], calls), "raw_calls": calls}
    streamed: dict[int, dict] = {}
    finish = None
    first_delta_ok = True
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return {"outcome": f"http_{response.status_code}", "message": response.text[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "choices" not in event:
                return {"outcome": "stream_error", "message": line[:200]}
            for part in event["choices"]:
                finish = part.get("finish_reason") or finish
                for delta in (part.get("delta") or {}).get("tool_calls") or []:
                    function = delta.get("function") or {}
                    if delta["index"] not in streamed:
                        first_delta_ok &= bool(delta.get("id") and function.get("name"))
                        streamed[delta["index"]] = {"name": function.get("name"), "arguments": ""}
                    streamed[delta["index"]]["arguments"] += function.get("arguments") or ""
    calls = [streamed[i] for i in sorted(streamed)]
    return {**judge_calls(mode, tool, finish, calls), "raw_calls": calls, "first_delta_has_id_and_name": first_delta_ok}


async def part_tools(base_url: str, rows: list[dict], per_set: int, max_tokens: int,
                     concurrency: int) -> dict[str, Any]:
    cases = tool_cases(rows, per_set)
    semaphore = asyncio.Semaphore(concurrency)
    results: dict[str, list[dict]] = {mode: [{} for _ in cases] for mode in TOOL_MODES}

    async def run(mode: str, i: int, http: httpx.AsyncClient) -> None:
        row_id, tool, messages = cases[i]
        async with semaphore:
            results[mode][i] = {"id": row_id, **await one_tool_request(http, base_url, mode, tool, messages,
                                                                      max_tokens)}

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as http:
        await asyncio.gather(*(run(mode, i, http) for mode in TOOL_MODES for i in range(len(cases))))
    modes = {}
    for mode, outcomes in results.items():
        count: dict[str, int] = {}
        for outcome in outcomes:
            count[outcome["outcome"]] = count.get(outcome["outcome"], 0) + 1
        modes[mode] = {"rows": len(outcomes), **count, "valid_rate": count.get("valid", 0) / len(outcomes),
                       "violations": count.get("violation", 0)}
    same = sum(s.get("raw_calls") == r.get("raw_calls") and s["outcome"] == r["outcome"]
               for s, r in zip(results["streamed"], results["required"], strict=True))
    return {"rows": len(cases), "max_tokens": max_tokens, "wall_s": time.perf_counter() - started, "modes": modes,
            "streamed_same_as_required": same,
            "streamed_first_delta_ok": sum(bool(s.get("first_delta_has_id_and_name")) for s in results["streamed"]
                                           if s.get("raw_calls")),
            "per_row": results}


async def bench_engine(name: str, start, rows: list[dict], args, parts: list[str]) -> dict[str, Any]:
    server = start()
    result: dict[str, Any] = {}
    try:
        result["ready_s"] = await first_served(server, timeout_s=900)
        result["info"] = server.info
        if "ttft" in parts:
            result["ttft"] = await part_ttft(server.base_url, rows, args.ttft_per_set)
            print(name, "ttft", json.dumps({k: v for k, v in result["ttft"].items() if k != "per_schema"}), flush=True)
        if "storm" in parts and name.startswith("kvscale"):
            result["storm"] = await part_storm(server.base_url, args.storm_rounds, args.storm_streams,
                                               args.storm_stream_tokens, args.storm_branches, args.storm_tokens)
            print(name, "storm", json.dumps({k: result["storm"][k] for k in (
                "storm_over_alone_p50", "storm_over_alone_p99", "storm_over_cached_p99")}), flush=True)
        if "tools" in parts:
            result["tools"] = await part_tools(server.base_url, rows, args.tool_rows_per_set, args.tool_max_tokens,
                                               args.concurrency)
            print(name, "tools", json.dumps(result["tools"]["modes"]), flush=True)
    finally:
        stop(server)
    return result


def kvscale_sides(args: argparse.Namespace, engine_flags: dict, log_dir: Path) -> list[tuple[str, Any]]:
    """(name, start) of each kvscale server the run measures, in order."""
    sides: list[tuple[str, Any]] = []
    if args.before_checkout:
        checkout = Path(args.before_checkout).resolve()
        sides.append(("kvscale_before", lambda: start_kvscale(engine_flags, args.threads, MODEL, log_dir, TOOL_FLAGS,
                                                              checkout=checkout, name="kvscale_before")))
    priorities = [p for p in args.compile_priorities.split(",") if p]
    if not priorities:
        sides.append(("kvscale", lambda: start_kvscale(engine_flags, args.threads, MODEL, log_dir, TOOL_FLAGS)))
    for priority in priorities:
        flags = (*TOOL_FLAGS, "--structured-outputs-config", json.dumps({"compile_priority": priority}))
        sides.append((f"kvscale_{priority}", lambda flags=flags, name=f"kvscale_{priority}": start_kvscale(
            engine_flags, args.threads, MODEL, log_dir, flags, name=name)))
    return sides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", default=None)
    parser.add_argument("--parts", default="ttft,storm,tools")
    parser.add_argument("--baselines", default="vllm", help="vllm, or none")
    add_before_checkout(parser, help="also serve kvscale from this source tree, first (an earlier commit's worktree)")
    parser.add_argument("--compile-priorities", default="", metavar="LIST",
                        help="one kvscale side per compile-thread priority (normal, nice, idle); "
                             "default: one side with the default configuration")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--ttft-per-set", type=int, default=2, help="schemas per non-BFCL set")
    parser.add_argument("--storm-rounds", type=int, default=3)
    parser.add_argument("--storm-streams", type=int, default=4)
    parser.add_argument("--storm-stream-tokens", type=int, default=160)
    parser.add_argument("--storm-branches", type=int, default=100)
    parser.add_argument("--storm-tokens", type=int, default=4, help="max_tokens of each storm request")
    parser.add_argument("--tool-rows-per-set", type=int, default=10)
    parser.add_argument("--tool-max-tokens", type=int, default=192)
    parser.add_argument("--output", default=str(RESULTS / "structured_outputs_serving.json"))
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    rows = load_rows(args.sample)
    # 512 MiB (vLLM: 1 GiB, its least): the shared machine's OOM killer took a 2 GiB engine once.
    engine_flags = {**ENGINE_FLAGS, "kv_cache_memory_bytes": 512 * 1024**2}
    log_dir = Path("/tmp/kvscale-bench-structured-serving")
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": {**machine(), "isa": cpu_isa()}, "argv": vars(args),
                              "engine_flags": engine_flags, "server_flags": list(TOOL_FLAGS),
                              "commits": {"this": git_commit(REPO),
                                          "before": git_commit(Path(args.before_checkout)) if args.before_checkout
                                          else None},
                              "engines": {}}
    sides = kvscale_sides(args, engine_flags, log_dir)
    if args.baselines == "vllm":
        sides.append(("vllm", lambda: start_vllm(engine_flags, args.threads, MODEL, log_dir, enforce_eager=False,
                                                 extra_args=TOOL_FLAGS)))
    for name, start in sides:
        started = time.strftime("%H:%M", time.gmtime())
        result["engines"][name] = asyncio.run(bench_engine(name, start, rows, args, parts))
        result["engines"][name]["utc"] = f"{started}-{time.strftime('%H:%M', time.gmtime())}"
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1))  # after each engine: a late failure keeps it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
