"""Which grammar library enforces JSON schemas here: llguidance and xgrammar measured side by side.

For every schema of the shared JSONSchemaBench sample (``../shared/data/jsonschemabench``) and the
bundled model's tokenizer, each library compiles the schema (time, or a refusal) and then feeds
every test instance of the row token by token (compact JSON, the whitespace both grammars allow):
a valid instance must be accepted, an invalid one rejected. Mask time is the time to fill one
token bitmask, measured at every position of the valid instances.

    python -m bench.grammar_libraries --out bench/results/grammar_libraries.json [--xgrammar-path DIR]
        [--kvscale-rewrites]

xgrammar is not a kvscale dependency: point ``--xgrammar-path`` at a directory it was installed
into (``pip install --no-deps --target DIR xgrammar apache-tvm-ffi``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.json_key_order import judged_valid
from bench.jsonschemabench import load_rows, sample_path
from bench.stats import nearest_rank
from kvscale.model_files import load_tokenizer, resolve_model_path


def backend_schema(schema: Any) -> Any:
    """The schema kvscale hands the library (its key order is the one the grammar generates)."""
    from kvscale.server.structured_outputs.schema_rewrites import rewrite_schema

    return rewrite_schema(schema)


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": statistics.median(values), "p99": nearest_rank(values, 0.99), "max": max(values)}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.ll = llguidance
        self.lt = lt
        self.tok = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                          eos_token=tokenizer.eos_token_id)
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)
        self.eos = tokenizer.eos_token_id

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def accepts(self, compiled: Any, ids: list[int], mask_times: list[float] | None) -> bool:
        matcher = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        for token in ids:
            if mask_times is not None:
                started = time.perf_counter()
                self.lt.fill_next_token_bitmask(matcher, self.bitmask, 0)
                mask_times.append(time.perf_counter() - started)
            if not matcher.consume_token(token):
                return False
        return matcher.is_accepting()


class KvscaleRewrites:
    """llguidance as kvscale's server uses it: the schema's refused keywords rewritten where an
    exact equivalent is proven (server/structured_outputs/schema_rewrites.py), the server's
    bounded whitespace. A valid instance rejected as written counts as accepted when some other
    key order of it is accepted (llguidance fixes the order of declared properties; JSON Schema
    ignores key order; bench/json_key_order.py); an invalid one must be rejected as written and
    in the schema's key order."""

    name = "llguidance + kvscale rewrites"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        from kvscale.server.structured_outputs import backend

        self.backend = backend
        self.tokenizer = tokenizer
        self.tok = backend.build_tokenizer(tokenizer, vocab_size, {tokenizer.eos_token_id})
        self.other_key_order = 0  # valid instances accepted only in another key order

    def compile(self, schema: dict) -> Any:
        from kvscale.server.sampling_params import StructuredOutputsParams

        spec = StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":")))
        return self.backend.compile_grammar(self.tok, self.backend.grammar_text(spec))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def accepts(self, compiled: Any, ids: list[int], mask_times: list[float] | None,
                instance: Any = None, schema: Any = None) -> bool:
        matcher = self.backend.Matcher.of(compiled)
        as_written = all(matcher.consume(token) for token in ids) and matcher.is_accepting()
        if mask_times is None:  # an invalid instance: rejected as written and in the schema's order
            return as_written or not judged_valid(compiled, self.encode, instance, schema, False)
        if as_written:
            return True
        accepted = judged_valid(compiled, self.encode, instance, schema, True)
        self.other_key_order += accepted
        return accepted


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.eos = tokenizer.eos_token_id

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True,
                                             separators=(",", ":"))

    def accepts(self, compiled: Any, ids: list[int], mask_times: list[float] | None) -> bool:
        matcher = self.xgr.GrammarMatcher(compiled)
        for token in ids:
            if mask_times is not None:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(self.bitmask, 0)
                mask_times.append(time.perf_counter() - started)
            if not matcher.accept_token(token):
                return False
        return bool(matcher.accept_token(self.eos) and matcher.is_terminated())


def measure(lib: Any, rows: list[dict], tokenizer: Any) -> dict:
    compile_s: list[float] = []
    mask_s: list[float] = []
    refused: list[str] = []
    wrong_accept = wrong_reject = checked = 0
    for row in rows:
        started = time.perf_counter()
        try:
            compiled = lib.compile(row["schema"])
        except Exception as exc:  # noqa: BLE001 - a refusal is the measured outcome
            refused.append(f"{row['id']}: {str(exc)[:120]}")
            continue
        compile_s.append(time.perf_counter() - started)
        for test in row.get("tests") or []:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if isinstance(lib, KvscaleRewrites):
                ok = lib.accepts(compiled, ids, [] if test["valid"] else None, test["data"],
                                 backend_schema(row["schema"]))
            else:
                ok = lib.accepts(compiled, ids, mask_s if test["valid"] else None)
            checked += 1
            if ok and not test["valid"]:
                wrong_accept += 1
            elif not ok and test["valid"]:
                wrong_reject += 1
    return {
        "schemas": len(rows), "compiled": len(compile_s), "refused": len(refused),
        "compile_ms": {k: (v * 1e3 if v is not None else None) for k, v in quantiles(compile_s).items()},
        "mask_us": {k: (v * 1e6 if v is not None else None) for k, v in quantiles(mask_s).items()},
        "instances_checked": checked, "wrong_acceptances": wrong_accept, "wrong_rejections": wrong_reject,
        "refusals": refused,
        **({"valid_accepted_only_in_another_key_order": lib.other_key_order}
           if isinstance(lib, KvscaleRewrites) else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--xgrammar-path", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--kvscale-rewrites", action="store_true",
                        help="also measure llguidance behind kvscale's exact schema rewrites")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    sample = str(args.sample or sample_path())
    rows = load_rows(sample)[: args.limit]
    path = resolve_model_path(None)
    tokenizer = load_tokenizer(path)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    libs: list[Any] = [LLGuidance(tokenizer, vocab_size)]
    if args.kvscale_rewrites:
        libs.append(KvscaleRewrites(tokenizer, vocab_size))
    if args.xgrammar_path:
        libs.append(XGrammar(tokenizer, vocab_size))
    result = {"date": time.strftime("%Y-%m-%d"), "sample": sample, "libraries": {}}
    for lib in libs:
        result["libraries"][lib.name] = measure(lib, rows, tokenizer)
        summary = {k: v for k, v in result["libraries"][lib.name].items() if k != "refusals"}
        print(lib.name, json.dumps(summary), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
