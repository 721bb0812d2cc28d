"""vLLM's CPU build as a single-stream baseline kept alive between passes, so a benchmark can
alternate its passes with its own engines' (paired ratios, as bench.spec_decode needs).

:class:`VllmStream` starts this file as a child in vLLM's venv (bench/anchors/vllm_cpu.py: its
venv, the same converted model, the threads pinned to cores ``0..threads-1``). The child loads
vLLM's offline ``LLM`` once (optionally with a ``speculative_config``, vLLM's dict), then answers
one pass per line on its stdin: each prompt (token ids) generated alone, greedy, one after the
other, and one ``@@PASS`` line back with the wall time, the tokens and vLLM's own speculative
decoding counters. If vLLM refuses the configuration, the child reports ``@@REFUSED`` with
vLLM's message instead of ``@@READY``. The child imports only the standard library and vllm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

READY, REFUSED, PASS = "@@READY ", "@@REFUSED ", "@@PASS "


class VllmStream:
    """A vLLM child holding one loaded model; ``refused`` holds vLLM's message when it would not load."""

    def __init__(self, *, threads: int, speculative_config: dict[str, Any] | None, max_model_len: int,
                 dtype: str = "float32", kv_cache_gib: int = 2, enable_prefix_caching: bool = True) -> None:
        from bench.anchors.vllm_cpu import ensure_venv, model_dir, vllm_env

        self.log: deque[str] = deque(maxlen=200)
        self.refused: str | None = None
        self.info: dict[str, Any] = {}
        spec = {"model": str(model_dir()), "dtype": dtype, "max_model_len": max_model_len,
                "enable_prefix_caching": enable_prefix_caching, "speculative_config": speculative_config}
        self._tmp = tempfile.TemporaryDirectory()
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen(
            [str(ensure_venv()), str(Path(__file__).resolve()), "--spec", str(spec_path)],
            env=self.env(vllm_env(threads, kv_cache_gib)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=self._tmp.name)
        tag, payload = self._read_until(READY, REFUSED)
        if tag == REFUSED:
            self.refused = payload["error"]
            self.close()
        else:
            self.info |= payload

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """vLLM's CPU install guide preloads Intel's OpenMP (its venv ships libiomp5); without it,
        vLLM warns, speculative decoding loses much of its speed."""
        from bench.anchors.vllm_cpu import venv_dir

        iomp = venv_dir() / "lib" / "libiomp5.so"
        if iomp.exists():
            base["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), base.get("LD_PRELOAD", "")]))
        self.info["ld_preload"] = base.get("LD_PRELOAD")
        return base

    def _read_until(self, *tags: str) -> tuple[str, dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            for tag in tags:
                if line.startswith(tag):
                    return tag, json.loads(line[len(tag):])
            self.log.append(line.rstrip()[-300:])
        raise SystemExit(f"vLLM child ended ({self.proc.wait()}):\n" + "\n".join(self.log))

    def run_pass(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Every prompt alone, in order; seconds, output tokens, answers, vLLM's draft counters."""
        assert self.proc.stdin is not None and self.refused is None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read_until(PASS)[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            from bench.anchors.vllm_cpu import end_child

            end_child(self.proc)
        self._tmp.cleanup()


# --- the child, inside vLLM's venv (stdlib + vllm only) ---------------------------------------


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative decoding counters, summed over their labels (0 without speculation)."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num") and hasattr(metric, "value"):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  enable_prefix_caching=spec["enable_prefix_caching"], max_num_seqs=8, seed=0,
                  speculative_config=spec["speculative_config"], disable_log_stats=False)
    except Exception as exc:  # vLLM's refusal of the configuration, reported as data
        print(REFUSED + json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
        return
    import vllm

    print(READY + json.dumps({"load_s": time.perf_counter() - started,
                              "vllm_version": getattr(vllm, "__version__", None)}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        work = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=work["max_tokens"])
        before = _counters(llm)
        answers = []
        begun = time.perf_counter()
        for prompt in work["prompts"]:
            output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            answers.append(list(output.outputs[0].token_ids))
        seconds = time.perf_counter() - begun
        after = _counters(llm)
        tokens = sum(len(a) for a in answers)
        print(PASS + json.dumps({
            "seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds, "answers": answers,
            "draft_tokens": after.get("vllm:spec_decode_num_draft_tokens", 0.0)
            - before.get("vllm:spec_decode_num_draft_tokens", 0.0),
            "accepted_tokens": after.get("vllm:spec_decode_num_accepted_tokens", 0.0)
            - before.get("vllm:spec_decode_num_accepted_tokens", 0.0)}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[sys.argv.index("--spec") + 1])
