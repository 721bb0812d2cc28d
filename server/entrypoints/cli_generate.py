"""`kvscale generate "prompt"`: a quick look at the engine (loads the model, prints the completion)."""

from __future__ import annotations

import argparse
import sys

from kvscale.server.config import KV_CACHE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text to complete")
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1, help="number of samples")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="what the KV cache stores: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def run(args: argparse.Namespace) -> int:
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, max_tokens=args.max_tokens,
        )
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype)
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvscale generate: error: {exc}", file=sys.stderr)
        return 2
    for completion in outputs[0].outputs:
        if args.n > 1:
            print(f"--- sample {completion.index} ({completion.finish_reason})")
        print(completion.text if args.chat else args.prompt + completion.text)
    return 0
