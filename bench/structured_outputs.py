"""Structured outputs against vLLM's CPU build, same machine, same run: JSONSchemaBench schemas
through ``response_format`` (greedy), then the same prompts unconstrained at the same lengths.

Per engine: coverage (valid answers ended by ``stop`` / schemas), compliance (valid / accepted),
answers that violate an accepted schema, refusals, cuts by ``max_tokens`` and those whose tail
is a whitespace run, and decode tok/s constrained ÷ unconstrained (the unconstrained pass asks
for exactly as many tokens as each constrained answer got, ``ignore_eos``).

    flock /tmp/kvscale-bench.lock python -m bench.structured_outputs --per-set 4 --baselines vllm
    flock -x /tmp/kvscale-bench.lock python -m bench.structured_outputs --per-set 0 --dtype bfloat16 \
        --concurrency 32 --baselines vllm,vllm:guidance   # vLLM's default backend and its guidance one

Writes bench/results/structured_outputs.json (machine, flags, per-schema outcomes, summary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.common import machine
from bench.http_servers import Server, first_served, start_kvscale, start_vllm, stop
from bench.jsonschemabench import load_rows, rows_per_set
from bench.roofline import cpu_isa

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2"
# Both sides' server flags: the same dtype (fp32 unless --dtype), lengths, batch and KV cache.
ENGINE_FLAGS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_model_len": 4096, "max_num_seqs": 32,
                                "max_num_batched_tokens": 4096, "block_size": 16, "enable_prefix_caching": True,
                                "kv_cache_memory_bytes": 2 * 1024**3}


# vLLM's structured-outputs backends (its --structured-outputs-config '{"backend": ...}').
VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def parse_baselines(text: str) -> list[tuple[str, str]]:
    """``--baselines`` as (engine name, vLLM structured-outputs backend) pairs: ``vllm`` is vLLM
    with its default backend (``auto``: xgrammar, guidance where xgrammar refuses),
    ``vllm:BACKEND`` one backend (engine ``vllm-BACKEND``); ``none`` or empty: no baseline."""
    pairs: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.split(",")):
        if item in ("", "none"):
            continue
        engine, _, backend = item.partition(":")
        if engine != "vllm" or (backend and backend not in VLLM_BACKENDS):
            raise ValueError(f"unknown baseline {item!r}: vllm or vllm:BACKEND, BACKEND one of {VLLM_BACKENDS}")
        name = "vllm" if backend in ("", "auto") else f"vllm-{backend}"
        if name not in (n for n, _ in pairs):
            pairs.append((name, backend or "auto"))
    return pairs


def vllm_backend_args(backend: str) -> tuple[str, ...]:
    """vLLM's server flags for this backend; none for its default, so old runs' commands hold."""
    return () if backend == "auto" else ("--structured-outputs-config", json.dumps({"backend": backend}))


def prompt_of(row: dict) -> list[dict]:
    text = json.dumps(row["schema"])[:1500]
    return [{"role": "user", "content": f"Write one JSON value that satisfies this JSON schema:\n{text}"}]


def judge(row: dict, status: int, body: dict) -> dict[str, Any]:
    if status == 400:
        return {"outcome": "refused", "tokens": 0, "message": body.get("error", {}).get("message", "")[:200]}
    if status != 200:
        return {"outcome": f"http_{status}", "tokens": 0}
    choice = body["choices"][0]
    text = choice["message"]["content"] or ""
    tokens = body["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        tail = text[-32:]
        return {"outcome": "length", "tokens": tokens, "whitespace_cut": len(text) >= 32 and not tail.strip()}
    try:
        jsonschema.validate(json.loads(text), row["schema"])
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
        return {"outcome": "invalid", "tokens": tokens, "error": str(exc)[:200]}
    return {"outcome": "valid", "tokens": tokens}


async def run_pass(base_url: str, rows: list[dict], *, constrained: bool, lengths: list[int] | None,
                   max_tokens: int, concurrency: int) -> tuple[list[dict], float, int]:
    """Outcomes, wall seconds and completion tokens of one pass over ``rows``."""
    semaphore = asyncio.Semaphore(concurrency)
    outcomes: list[dict] = [{} for _ in rows]
    total_tokens = 0

    async def one(i: int, row: dict, http: httpx.AsyncClient) -> None:
        nonlocal total_tokens
        body: dict[str, Any] = {"model": MODEL, "messages": prompt_of(row), "temperature": 0,
                                "max_tokens": max_tokens}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": row["schema"], "strict": True}}
        else:
            assert lengths is not None
            if lengths[i] <= 0:
                return
            body.update(max_tokens=lengths[i], ignore_eos=True)
        async with semaphore:
            response = await http.post(f"{base_url}/v1/chat/completions", json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        if constrained:
            outcomes[i] = judge(row, response.status_code, payload)
        if response.status_code == 200:
            total_tokens += payload["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as http:
        await asyncio.gather(*(one(i, row, http) for i, row in enumerate(rows)))
    return outcomes, time.perf_counter() - started, total_tokens


def summarize(rows: list[dict], outcomes: list[dict], constrained: tuple[float, int],
              unconstrained: tuple[float, int]) -> dict[str, Any]:
    count = {k: sum(o.get("outcome") == k for o in outcomes) for k in ("valid", "length", "refused", "invalid")}
    accepted = len(rows) - count["refused"]
    c_tps = constrained[1] / constrained[0] if constrained[0] else 0.0
    u_tps = unconstrained[1] / unconstrained[0] if unconstrained[0] else 0.0
    return {
        "schemas": len(rows), **count,
        "other": len(rows) - sum(count.values()),
        "coverage": count["valid"] / len(rows),
        "compliance": count["valid"] / accepted if accepted else 0.0,
        "whitespace_cuts": sum(bool(o.get("whitespace_cut")) for o in outcomes),
        "constrained_tok_s": c_tps, "unconstrained_tok_s": u_tps,
        "constrained_over_unconstrained": c_tps / u_tps if u_tps else 0.0,
        "constrained_s": constrained[0], "constrained_tokens": constrained[1],
        "unconstrained_s": unconstrained[0], "unconstrained_tokens": unconstrained[1],
    }


def per_set(per_schema: list[dict]) -> dict[str, dict[str, Any]]:
    """Outcome counts and coverage per JSONSchemaBench set, in the order sets first appear."""
    sets: dict[str, dict[str, Any]] = {}
    for row in per_schema:
        counts = sets.setdefault(row["set"], {"schemas": 0, "valid": 0, "length": 0, "refused": 0, "invalid": 0})
        counts["schemas"] += 1
        if row.get("outcome") in counts:
            counts[row["outcome"]] += 1
    for counts in sets.values():
        counts["coverage"] = counts["valid"] / counts["schemas"]
    return sets


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """kvscale over each vLLM backend, and over vLLM's best (highest coverage; the faster
    constrained decode breaks a tie), which the issue's targets compare against."""
    ours = engines["kvscale"]

    def over(theirs: dict[str, Any]) -> dict[str, float | None]:
        return {
            "coverage_over_vllm": ours["coverage"] / theirs["coverage"] if theirs["coverage"] else None,
            "constrained_tok_s_over_vllm": (ours["constrained_tok_s"] / theirs["constrained_tok_s"]
                                            if theirs["constrained_tok_s"] else None),
        }

    vllms = {name: result for name, result in engines.items() if name.startswith("vllm")}
    if not vllms:
        return {}
    best = max(vllms, key=lambda name: (vllms[name]["coverage"], vllms[name]["constrained_tok_s"]))
    return {**over(vllms[best]), "vllm_best": best, "per_backend": {name: over(r) for name, r in vllms.items()}}


async def bench_engine(name: str, start: Callable[[], Server], rows: list[dict],
                       args: argparse.Namespace) -> dict[str, Any]:
    server = start()
    try:
        ready_s = await first_served(server, timeout_s=900)
        # Warm-up outside the timings: one constrained request (first compile, first mask), then
        # every prompt once for one token, so both timed passes find their prompts cached and
        # compare decoding, not who prefilled.
        await run_pass(server.base_url, rows[:1], constrained=True, lengths=None, max_tokens=8, concurrency=1)
        await run_pass(server.base_url, rows, constrained=False, lengths=[1] * len(rows), max_tokens=1,
                       concurrency=args.concurrency)
        outcomes, c_s, c_tokens = await run_pass(server.base_url, rows, constrained=True, lengths=None,
                                                 max_tokens=args.max_tokens, concurrency=args.concurrency)
        lengths = [o.get("tokens", 0) for o in outcomes]
        _, u_s, u_tokens = await run_pass(server.base_url, rows, constrained=False, lengths=lengths,
                                          max_tokens=args.max_tokens, concurrency=args.concurrency)
    finally:
        stop(server)
    result = summarize(rows, outcomes, (c_s, c_tokens), (u_s, u_tokens))
    result["ready_s"] = ready_s
    result["info"] = server.info
    result["per_schema"] = [{"id": row["id"], "set": row["set"], **o} for row, o in zip(rows, outcomes, strict=True)]
    result["per_set"] = per_set(result["per_schema"])
    print(name, json.dumps({k: v for k, v in result.items() if k not in ("per_schema", "per_set", "info")}), flush=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sample", default=None)
    parser.add_argument("--per-set", type=int, default=4, help="schemas per set (0: the whole sample)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="both sides' --dtype (vLLM's spelling; float32 as in the earlier runs)")
    parser.add_argument("--baselines", default="vllm",
                        help="comma-separated: vllm (its default backend), vllm:BACKEND (e.g. vllm:guidance), or none")
    parser.add_argument("--output", default=str(RESULTS / "structured_outputs.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        baselines = parse_baselines(args.baselines)
    except ValueError as exc:
        parser.error(str(exc))
    rows = load_rows(args.sample)
    if args.per_set:
        rows = rows_per_set(rows, args.per_set)
    engine_flags = {**ENGINE_FLAGS, "dtype": args.dtype}
    log_dir = Path("/tmp/kvscale-bench-structured")
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": {**machine(), "isa": cpu_isa()}, "threads": args.threads,
                              "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                              "engine_flags": engine_flags, "schemas": len(rows),
                              "vllm_backends": dict(baselines), "engines": {}}
    sides: list[tuple[str, Callable[[], Server]]] = [
        ("kvscale", partial(start_kvscale, engine_flags, args.threads, MODEL, log_dir))]
    sides += [(name, partial(start_vllm, engine_flags, args.threads, MODEL, log_dir, enforce_eager=False,
                             extra_args=vllm_backend_args(backend), name=name)) for name, backend in baselines]
    for name, start in sides:
        result["engines"][name] = asyncio.run(bench_engine(name, start, rows, args))
    if baselines:
        result["ratios"] = ratios(result["engines"])
        print("ratios", json.dumps(result["ratios"]))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
