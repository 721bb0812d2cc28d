"""KV memory one long sequence holds in a sliding-window model: window blocks freed vs every block kept.

A tiny random-weight Gemma 3 (six layers, five of them sliding-window layers of ``--window`` tokens,
Gemma 3's pattern; transformers' config, saved with save_pretrained: nothing downloads) serves one
prompt of ``--tokens`` tokens and decodes ``--new-tokens`` more, in float32 on CPU, twice in one run:
with the sliding-window layers in their own KV group whose blocks behind the window go back to the
pool (server/core/window_group.py, the default), and with that group turned off (every layer keeps
every block, the engine before it). After every engine step the bytes of KV blocks held are read
from the pools (blocks held by the sequence times each group's bytes a block). Reported: the held
bytes at the last decode step and the peak over the run, each side, and their ratios; and whether
the two runs' greedy tokens are equal.

    flock /tmp/kvscale-bench.lock python -m bench.window_kv_memory   # writes bench/results/window_kv_memory.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, write_result


def _checkpoint(path: Path, window: int, max_len: int) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from kvscale.model_files import load_tokenizer, resolve_model_path

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=max_len, sliding_window=window,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    load_tokenizer(resolve_model_path(None)).save_pretrained(str(path))


def _run(path: Path, args: argparse.Namespace, window_group: bool) -> dict[str, Any]:
    import kvscale.server.engine.engine_build as engine_build
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams

    own = engine_build.window_group_of
    if not window_group:
        engine_build.window_group_of = lambda config, spec: None  # type: ignore[assignment]
    try:
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=args.block_size,
                                        max_num_batched_tokens=args.chunk, max_num_seqs=4,
                                        kv_cache_memory_bytes=args.kv_cache_mib * 2**20))
    finally:
        engine_build.window_group_of = own
    runner = engine.runner
    full_block = runner.kv_cache.stride(2) * runner.kv_cache.shape[0] * 2 * runner.kv_cache.element_size()
    window_block = 0
    if runner.window_cache is not None:
        cache = runner.window_cache
        window_block = cache.stride(2) * cache.shape[0] * 2 * cache.element_size()

    def held() -> int:
        window = engine.kv.window
        return engine.pool.num_active_blocks * full_block + (
            window.pool.num_active_blocks * window_block if window is not None else 0)

    prompt = [3 + (i * 7919) % 509 for i in range(args.tokens)]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    trace: list[int] = []
    tokens: list[int] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        # Read before the step frees a finished sequence's blocks: a step's blocks are allocated
        # when it is scheduled, so this is what the step before held while it ran.
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if engine.has_unfinished_requests():
            trace.append(held())
    return {"window_group": window_group, "full_block_bytes": full_block, "window_block_bytes": window_block,
            "held_bytes_last_decode": trace[-1], "held_bytes_peak": max(trace), "steps": len(trace),
            "seconds": round(time.perf_counter() - started, 2), "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        _checkpoint(path, args.window, args.tokens + args.new_tokens + 64)
        freed, kept = _run(path, args, True), _run(path, args, False)
    result = {
        "config": vars(args), "machine": machine(),
        "ratio_last_decode": round(freed["held_bytes_last_decode"] / kept["held_bytes_last_decode"], 4),
        "ratio_peak": round(freed["held_bytes_peak"] / kept["held_bytes_peak"], 4),
        "tokens_equal": freed.pop("tokens") == kept.pop("tokens"),
        "window_freed": freed, "every_block_kept": kept,
    }
    print({k: result[k] for k in ("ratio_last_decode", "ratio_peak", "tokens_equal")})
    print(write_result("window_kv_memory", result, args.out))


if __name__ == "__main__":
    main()
