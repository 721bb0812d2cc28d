"""bench.lora's vLLM side: vLLM's CPU build (bench/anchors/vllm_cpu.py: its own venv, the model
directory kvscale converts the bundled GGUF into, its OpenMP team pinned to cores
``0..threads-1``) with ``enable_lora``, serving the same PEFT adapters on the same requests as
bench.lora_engine's mixed side.

vLLM's offline ``LLM`` is built as kvscale's LoRA engine is: ``max_loras`` = the mixed adapters'
count, ``max_lora_rank`` = their rank, ``max_num_seqs`` = the request count, the same
``max_num_batched_tokens``, dtype and prefix caching. Request i names adapter i mod 8 through a
``LoRARequest`` (bench.lora_engine.mixed_names); greedy, ``ignore_eos``, the same ``max_tokens``;
each pass its own ``cache_salt``, so none reuses another's prefix cache. After an untimed warm-up
that loads every adapter, ``rounds`` passes of the requests with no adapter and mixed alternate,
the order rotated per round, then each side's prefill alone (one output token per request, best
of two) splits a pass into prefill and decode, as on kvscale's side.

If vLLM refuses (LoRA on this platform, the model, the adapters' format), the child records its
exception's type and message as ``refused`` and no figure is made from it.

This file is also the child program inside vLLM's venv (``--spec``/``--result``): that part
imports only the standard library and vllm, since kvscale is not installed there.
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

MAX_MODEL_LEN = 2048


def vllm_spec(args: argparse.Namespace, adapters: dict[str, str], model: str) -> dict[str, Any]:
    """What the child runs: the LLM's settings, the requests (bench.w1_throughput's workload), the
    adapter each request names and the passes."""
    from bench.lora_engine import mixed_names
    from bench.w1_throughput import workload

    prompts, outputs = workload(args)
    if max(len(p) + n for p, n in zip(prompts, outputs, strict=True)) > MAX_MODEL_LEN:
        raise ValueError(f"a request is longer than vLLM's max_model_len {MAX_MODEL_LEN}")
    return {
        "llm": {"model": model, "dtype": args.dtype, "enable_lora": True, "max_loras": len(adapters),
                "max_cpu_loras": len(adapters), "max_lora_rank": args.rank, "max_num_seqs": len(prompts),
                "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": MAX_MODEL_LEN,
                "enable_prefix_caching": True, "seed": 0},
        "adapters": adapters,
        "prompts": prompts,
        "max_tokens": outputs,
        "names": mixed_names(len(prompts), list(adapters)),
        "rounds": args.rounds,
    }


def child_env(threads: int, kv_cache_bytes: int) -> dict[str, str]:
    """bench.anchors.vllm_cpu's environment (threads pinned, KV budget in whole GiB, at least
    one), with Intel's OpenMP preloaded as vLLM's CPU install guide asks (its venv ships it)."""
    from bench.anchors.vllm_cpu import venv_dir, vllm_env

    env = vllm_env(threads, max(1, round(kv_cache_bytes / 1024**3)))
    iomp = venv_dir() / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    return env


def summarize(passes: dict[str, list[float]], prefill_s: dict[str, float], useful_tokens: int) -> dict[str, Any]:
    """Medians of each side's tok/s, the paired mixed ÷ no-adapter ratios, and each side's decode
    time (a median pass's time less its prefill)."""
    medians = {side: statistics.median(v) for side, v in passes.items()}
    ratios = [m / b for m, b in zip(passes["mixed"], passes["base_on_lora_engine"], strict=True)]
    return {"tok_s": passes, "tok_s_median": medians, "mixed_over_base_on_lora_engine_paired": ratios,
            "mixed_over_base_on_lora_engine_median": statistics.median(ratios), "prefill_s": prefill_s,
            "decode_s": {side: useful_tokens / medians[side] - prefill_s[side] for side in prefill_s}}


def side_vllm(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, Any]:
    """Run the child in vLLM's venv; its passes summarized, or ``refused`` with vLLM's error."""
    from bench.anchors.vllm_cpu import ensure_venv, kernels_from_log, model_dir

    spec = vllm_spec(args, adapters, str(model_dir()))
    python = ensure_venv()
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--spec", str(spec_path),
                               "--result", str(out_path)], env=child_env(args.threads, args.kv_cache_bytes),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        if not out_path.exists():
            raise SystemExit(f"vLLM's LoRA side failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
        child = json.loads(out_path.read_text())
    result: dict[str, Any] = {key: child[key] for key in child if key not in ("passes", "prefill_s")}
    if "refused" not in child:
        result |= summarize(child["passes"], child["prefill_s"], sum(spec["max_tokens"]))
    result["kernels"] = kernels_from_log(proc.stdout)
    result["log_tail"] = proc.stdout[-2000:]
    return result


# --- the child, inside vLLM's venv (stdlib + vllm only) ---------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        llm = LLM(**spec["llm"], disable_log_stats=True)
    except Exception as exc:  # vLLM's refusal of LoRA here, reported as data
        return {"refused": f"{type(exc).__name__}: {exc}"[:2000]}
    import torch
    import vllm

    load_s = time.perf_counter() - started
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["adapters"].items())}
    sides = {"base_on_lora_engine": [None] * len(spec["prompts"]),
             "mixed": [requests[name] for name in spec["names"]]}

    def run(side: str, prompts: list[list[int]], max_tokens: list[int], salt: str) -> tuple[float, list[list[int]]]:
        inputs = [TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        begun = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=sides[side][:len(prompts)])
        seconds = time.perf_counter() - begun
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        if sum(map(len, answers)) != sum(max_tokens):
            raise RuntimeError(f"vLLM generated {sum(map(len, answers))} tokens, not {sum(max_tokens)}")
        return seconds, answers

    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    try:
        for side in sides:  # untimed: first-use costs, every adapter loaded
            run(side, [p[:32] for p in prompts[:8]], [4] * min(8, len(prompts)), f"warm-{side}")
        passes: dict[str, list[float]] = {side: [] for side in sides}
        answers: dict[str, list[list[int]]] = {}
        order = list(sides)
        for r in range(spec["rounds"]):
            for side in order[r % len(order):] + order[:r % len(order)]:
                seconds, answers[side] = run(side, prompts, max_tokens, f"r{r}-{side}")
                passes[side].append(sum(max_tokens) / seconds)
        prefill_s = {side: min(run(side, prompts, [1] * len(prompts), f"prefill{r}-{side}")[0] for r in range(2))
                     for side in sides}
    except Exception as exc:  # a refusal at the first adapter's load or step, as data
        return {"refused": f"{type(exc).__name__}: {exc}"[:2000], "load_s": load_s}
    return {
        "passes": passes, "prefill_s": prefill_s, "load_s": load_s,
        # Evidence the adapters act: answers of the mixed pass that differ from the no-adapter one's.
        "mixed_answers_unlike_base": sum(a != b for a, b in zip(answers["mixed"], answers["base_on_lora_engine"],
                                                                   strict=True)),
        "vllm_version": getattr(vllm, "__version__", None), "torch_version": torch.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "settings": {key: value for key, value in spec["llm"].items() if key != "model"},
    }


if __name__ == "__main__":
    spec_file, result_file = sys.argv[sys.argv.index("--spec") + 1], sys.argv[sys.argv.index("--result") + 1]
    Path(result_file).write_text(json.dumps(_child(json.loads(Path(spec_file).read_text()))))
