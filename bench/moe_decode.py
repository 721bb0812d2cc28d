"""MoE decode tok/s on CPU: kvscale ÷ vLLM's CPU build on the same tiny random Qwen3-MoE, one run.

A Qwen3-MoE checkpoint of random weights is written to a temporary directory from transformers'
own ``Qwen3MoeConfig`` and ``save_pretrained`` (safetensors, bfloat16; nothing downloads; the
bundled model's tokenizer beside it for kvscale, vLLM starts with ``skip_tokenizer_init``). Each
engine runs in a child process kept alive between passes: kvscale's offline ``LLM`` (this tree,
or with ``--before-checkout`` another commit's tree as a further side), vLLM's offline ``LLM`` in
its own venv (bench/anchors/vllm_cpu.py: cores ``0..threads-1``, Intel's OpenMP preloaded). If
vLLM refuses the model, its error is recorded and transformers' ``generate()`` is the baseline.

A pass: the first ``B`` of fixed token-id prompts, greedy, ``ignore_eos``, ``--output-len``
tokens each, prefix caching off on every side, the same dtype on every side (``--dtype``).
Decode tok/s of a pass is ``B * (output_len - 1) / (t_full - t_one)``, ``t_one`` the same
prompts with one output token (the prefill and the first token) timed in the same round. Each
round runs every side once per batch size, the order rotated per round; the figure is the median
of the rounds' paired ratios. The one-token passes' medians are recorded too (``prefill_s_median``).

    /tmp/quiet python -m bench.moe_decode            # writes bench/results/moe_decode.json

This file is also the child program (``--child``): its top level imports only the standard
library, since vLLM's venv has no kvscale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPLY = "@@MOE "
SHAPE_FLAGS = {"hidden": 512, "layers": 4, "experts": 32, "top_k": 4, "moe_intermediate": 256, "vocab": 4096,
               "heads": 8, "kv_heads": 4, "head_dim": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in SHAPE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--batches", default="1,16", help="sequences per pass, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", help="every side's dtype")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline", choices=["vllm", "hf"], default="vllm",
                        help="hf: transformers generate() without trying vLLM")
    parser.add_argument("--settle-s", type=float, default=0.3,
                        help="pause before each pass: the last side's OpenMP threads stop spinning")
    parser.add_argument("--before-checkout", default=None, help="a tree of another commit: its kvscale as a side")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    if args.output_len < 2 or min(args.batch_sizes) < 1:
        parser.error("--output-len must be at least 2 and every batch at least 1")
    return args


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in SHAPE_FLAGS}


def qwen3_moe_config(shape: dict[str, int], dtype: str, max_len: int) -> Any:
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": shape["vocab"], "hidden_size": shape["hidden"], "intermediate_size": 2 * shape["hidden"],
        "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"], "head_dim": shape["head_dim"], "num_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"], "moe_intermediate_size": shape["moe_intermediate"],
        "norm_topk_prob": True, "max_position_embeddings": max_len, "bos_token_id": 1, "eos_token_id": 2,
        "dtype": dtype}
    return transformers.Qwen3MoeConfig(**fields)


def write_checkpoint(path: Path, shape: dict[str, int], dtype: str, max_len: int, tokenizer_from: Path | None) -> None:
    """Random weights (seed 0) in the hub's per-expert names, and a tokenizer where one is given."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(shape, dtype, max_len), dtype=getattr(torch, dtype))
    model.save_pretrained(str(path))
    if tokenizer_from is not None:
        from kvscale.model_files import load_tokenizer

        load_tokenizer(tokenizer_from).save_pretrained(str(path))


def prompts_of(count: int, length: int, vocab: int) -> list[list[int]]:
    """Fixed token-id prompts, every id in the model's vocabulary and past its special ids."""
    return [[3 + (i * 7919 + j * 104729) % (vocab - 3) for j in range(length)] for i in range(count)]


def decode_tok_s(batch: int, output_len: int, full_s: float, one_s: float) -> float:
    """Decode tokens a second: the tokens after each sequence's first over the time they added."""
    if full_s <= one_s:
        raise ValueError(f"a pass of {output_len} tokens ({full_s:.4f} s) took no longer than one ({one_s:.4f} s)")
    return batch * (output_len - 1) / (full_s - one_s)


def paired(top: list[float], bottom: list[float]) -> dict[str, float]:
    ratios = [a / b for a, b in zip(top, bottom, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def rotated(sides: list[str], round_: int) -> list[str]:
    shift = round_ % len(sides)
    return sides[shift:] + sides[:shift]


def summarize(tok_s: dict[str, dict[str, list[float]]], baseline: str) -> dict[str, Any]:
    """Per batch size: each side's median decode tok/s and its paired ratios over ``baseline``."""
    out: dict[str, Any] = {}
    for batch, sides in tok_s.items():
        out[batch] = {"tok_s_median": {side: statistics.median(v) for side, v in sides.items()},
                      "over_" + baseline: {side: paired(v, sides[baseline]) for side, v in sides.items()
                                           if side != baseline}}
        if "kvscale_before" in sides:
            out[batch]["kvscale_over_before"] = paired(sides["kvscale"], sides["kvscale_before"])
    return out


class Child:
    """One engine in its own process: loaded once, then one pass per line on its stdin."""

    def __init__(self, argv: list[str], env: dict[str, str], spec: dict[str, Any]) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log: list[str] = []
        self.proc = subprocess.Popen([*argv, str(Path(__file__).resolve()), "--child", str(spec_path)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=self._tmp.name)
        self.info = self._reply()
        self.refused: str | None = self.info.get("refused")

    def _reply(self) -> dict[str, Any]:
        # Imported here: the child runs this file too and imports only the standard library.
        from bench.anchors.vllm_cpu import child_reply

        return child_reply(self.proc, REPLY, self.log, "an engine child")

    def run(self, batch: int, max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"batch": batch, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        from bench.anchors.vllm_cpu import end_child

        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        end_child(self.proc)
        self._tmp.cleanup()


def start_side(side: str, args: argparse.Namespace, spec: dict[str, Any]) -> Child:
    from bench.common import REPO, checkout_env

    if side == "vllm":
        from bench.anchors.vllm_cpu import ensure_venv
        from bench.lora_vllm import child_env

        return Child([str(ensure_venv())], child_env(args.threads, 1 << 30), {**spec, "side": "vllm"})
    tree = Path(args.before_checkout) if side == "kvscale_before" else REPO
    env = checkout_env(tree, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return Child([sys.executable], env, {**spec, "side": "hf" if side == "hf" else "kvscale"})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.common import git_commit, machine, write_result
    from bench.roofline import cpu_isa, memory_stream
    from kvscale.model_files import resolve_model_path

    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = os.getloadavg()
    stream_before = memory_stream(args.threads)
    max_len = args.prompt_len + args.output_len + 16
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), shape_of(args), args.dtype, max_len, resolve_model_path(None))
        spec = {"model": tmp, "dtype": args.dtype, "threads": args.threads, "max_len": max_len,
                "max_num_seqs": max(args.batch_sizes),
                "prompts": prompts_of(max(args.batch_sizes), args.prompt_len, args.vocab)}
        sides = ["kvscale"] + (["kvscale_before"] if args.before_checkout else [])
        children: dict[str, Child] = {}
        refused: str | None = None
        try:
            for side in sides:
                children[side] = start_side(side, args, spec)
            baseline = args.baseline
            if baseline == "vllm":
                vllm = start_side("vllm", args, spec)
                if vllm.refused is not None:
                    refused, baseline = vllm.refused, "hf"
                    vllm.close()
                    print(f"vLLM refused the model: {refused[:300]}", flush=True)
                else:
                    children["vllm"] = vllm
            if baseline == "hf":
                children["hf"] = start_side("hf", args, spec)
            order = list(children)
            tok_s: dict[str, dict[str, list[float]]] = {str(b): {s: [] for s in order} for b in args.batch_sizes}
            # The one-token passes: each batch's prompts prefilled (and a first token sampled).
            prefill_s: dict[str, dict[str, list[float]]] = {str(b): {s: [] for s in order} for b in args.batch_sizes}
            first_tokens: dict[str, dict[str, list[int]]] = {str(b): {} for b in args.batch_sizes}
            for r in range(args.rounds):
                for batch in args.batch_sizes:
                    for side in rotated(order, r):
                        time.sleep(args.settle_s)
                        full = children[side].run(batch, args.output_len)
                        time.sleep(args.settle_s)
                        one = children[side].run(batch, 1)
                        prefill_s[str(batch)][side].append(one["seconds"])
                        tok_s[str(batch)][side].append(
                            decode_tok_s(batch, args.output_len, full["seconds"], one["seconds"]))
                        first_tokens[str(batch)].setdefault(side, full["first_tokens"])
                        print(f"round {r} batch {batch} {side}: {tok_s[str(batch)][side][-1]:.1f} decode tok/s",
                              flush=True)
        finally:
            for child in children.values():
                child.close()
    summary = summarize(tok_s, baseline)
    for batch, by_side in prefill_s.items():
        summary[batch]["prefill_s_median"] = {side: statistics.median(v) for side, v in by_side.items()}
    print(json.dumps(summary, indent=1), flush=True)
    result = {
        "benchmark": "moe_decode",
        "command": " ".join(["python -m bench.moe_decode", *(argv if argv is not None else sys.argv[1:])]),
        "started_at": started_at, "commit": git_commit(Path(__file__).resolve().parents[1]),
        "before_commit": git_commit(Path(args.before_checkout)) if args.before_checkout else None,
        "machine": {**machine(), "cpu": cpu_isa(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
                    "memory_stream_before": stream_before, "memory_stream_after": memory_stream(args.threads)},
        "model": {"family": "Qwen3-MoE (transformers Qwen3MoeConfig, random weights, seed 0)", **shape_of(args),
                  "norm_topk_prob": True, "dtype": args.dtype},
        "workload": {"batches": args.batch_sizes, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "rounds": args.rounds, "threads": args.threads, "greedy": True, "ignore_eos": True,
                     "prefix_caching": False},
        "baseline": baseline, "vllm_refused": refused,
        "sides": {side: child.info for side, child in children.items()},
        "summary": summary, "decode_tok_s": tok_s,
        "first_tokens_of_first_sequence": first_tokens,
    }
    print(write_result("moe_decode", result, args.out))
    return 0


# --- the child: kvscale (project venv), transformers (project venv) or vLLM (its venv) ---------


def _say(payload: dict[str, Any]) -> None:
    print(REPLY + json.dumps(payload), flush=True)


def _engine(spec: dict[str, Any]) -> tuple[Any, str]:
    """A callable running ``(prompts, max_tokens)`` to the first sequence's output ids, and the
    dtype the engine resolved."""
    if spec["side"] == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_len"],
                  max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=False, skip_tokenizer_init=True, seed=0)

        def run_vllm(prompts: list[list[int]], n: int) -> list[int]:
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return list(outs[0].outputs[0].token_ids)

        return run_vllm, str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["side"] == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()

        def run_hf(prompts: list[list[int]], n: int) -> list[int]:
            with torch.inference_mode():
                out = model.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long))
            return [int(t) for t in out[0, len(prompts[0]):]]

        return run_hf, str(model.dtype).removeprefix("torch.")
    from kvscale.server.entrypoints.llm import LLM as KvLLM
    from kvscale.server.sampling_params import SamplingParams as KvParams

    kv = KvLLM(model=spec["model"], dtype=spec["dtype"], device="cpu", max_model_len=spec["max_len"],
               max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=False, kv_cache_memory_bytes=512 << 20)

    def run_kvscale(prompts: list[list[int]], n: int) -> list[int]:
        outs = kv.generate(prompts, KvParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        return list(outs[0].outputs[0].token_ids)

    return run_kvscale, str(kv.llm_engine.runner.dtype).removeprefix("torch.")


def _child(spec: dict[str, Any]) -> None:
    started = time.perf_counter()
    try:
        run, resolved = _engine(spec)
        run(spec["prompts"][:2], 4)  # untimed: first-use costs
    except Exception as exc:  # a refusal of the model, reported as data
        _say({"refused": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    import torch

    info: dict[str, Any] = {"load_s": time.perf_counter() - started, "torch_version": torch.__version__,
                            "dtype": resolved, "torch_threads": torch.get_num_threads()}
    if spec["side"] == "vllm":
        import vllm

        info |= {"vllm_version": getattr(vllm, "__version__", None),
                 "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                 "ld_preload": os.environ.get("LD_PRELOAD")}
    _say(info)
    for line in sys.stdin:
        work = json.loads(line)
        prompts = spec["prompts"][:work["batch"]]
        begun = time.perf_counter()
        tokens = run(prompts, work["max_tokens"])
        seconds = time.perf_counter() - begun
        if len(tokens) != work["max_tokens"]:
            raise RuntimeError(f"{spec['side']} generated {len(tokens)} tokens, not {work['max_tokens']}")
        _say({"seconds": seconds, "first_tokens": tokens[:16]})


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(json.loads(Path(sys.argv[sys.argv.index("--child") + 1]).read_text()))
    else:
        raise SystemExit(main())
