"""Shared bits of the engine benchmarks: workload generation, child processes, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MOONCAKE_TRACE = ("traces", "mooncake_conversation_trace.jsonl")
# Prompts of different lengths (some span several 16-token blocks) for the greedy checks of the
# engine against transformers: the tests on CPU and bench.gpu_engine on a GPU.
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. Every morning the youngest",
    "Q: What is 12 times 7?\nA:",
    "List three colours of the rainbow:",
]


def shared_data(*parts: str) -> Path:
    """``shared/data/<parts>`` beside the nearest ancestor of the checkout that has it: the
    project's ``../shared/data``, found from a worktree or clone nested deeper too."""
    for parent in REPO.parents:
        candidate = parent.joinpath("shared", "data", *parts)
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{'/'.join(parts)} is missing: expected ../shared/data/{'/'.join(parts)} "
                            "beside the checkout")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": round(load[0], 2),
        "python": platform.python_version(),
    }


def redis_server_binary() -> str:
    """redis-server's path, for the benchmarks that start their own Redis; exits saying why without it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("needs redis-server on the PATH (make system-deps)")
    return binary


@dataclass(frozen=True)
class StreamOutcome:
    ok: bool  # answered whole: 200, ending with ``data: [DONE]``
    began: bool  # a byte of a 200 answer had arrived (an error answer's body is no stream)
    replica: str  # the router's ``x-kvscale-replica`` header ("" without one)


def streamed_completion(url: str, body: dict[str, Any], timeout: float) -> StreamOutcome:
    """POST ``body`` (a streamed completion) to ``url`` and read the answer to its end, for the
    benchmarks and tests that kill a replica while streams are open: whether it came whole,
    whether it had begun streaming (a failure before that could have been retried elsewhere)."""
    import httpx

    began, ok, replica, text = False, False, "", b""
    try:
        with httpx.stream("POST", url, json=body, timeout=timeout) as response:
            replica = response.headers.get("x-kvscale-replica", "")
            for chunk in response.iter_raw():
                began = response.status_code == 200
                text += chunk
            ok = response.status_code == 200 and text.endswith(b"data: [DONE]\n\n")
    except httpx.HTTPError:
        ok = False
    return StreamOutcome(ok, began, replica)


def git_commit(tree: Path) -> str | None:
    """The commit checked out in ``tree`` (a repository or worktree), or None outside git."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_env(checkout: Path, **extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, importing kvscale and bench from ``checkout``
    when it is another tree (not an installed or inherited copy)."""
    env = {**os.environ, **extra}
    if Path(checkout).resolve() != REPO:
        env["PYTHONPATH"] = str(Path(checkout).resolve())
    return env


def run_side(module: str, side: str, args: list[str], checkout: Path = REPO) -> dict[str, Any]:
    """Run one side of a benchmark in its own process, so its peak memory is its own; ``checkout``:
    the tree whose code it runs (another commit's worktree: bench.before_after)."""
    cmd = [sys.executable, "-m", module, "--side", side, *args]
    env = checkout_env(checkout, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{module} --side {side} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sync(device: Any) -> None:
    """Wait for ``device``'s queued work (a CUDA device's kernels run asynchronously), so that a
    wall time counts it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a cancelled job) ends the benchmark as Ctrl-C does: an exception
    in the main thread, so every ``finally`` and ``with`` stops what the run started. Python's
    default ends the process on the spot, and what has no death signal outlives it (a container,
    the pods' network namespaces, a temporary folder). A second SIGTERM ends it at once."""

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise SystemExit(128 + signum)  # the status a shell reports for a process the signal ended

    signal.signal(signal.SIGTERM, stop)


def write_result(name: str, result: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path


def median_ms(action: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median wall time of ``action`` in milliseconds over ``repeats`` calls, after ``warmup``
    untimed ones."""
    for _ in range(warmup):
        action()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def op_bench_args(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """Flags of the op benchmarks (C kernels, projections), with torch's threads set from them."""
    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def strip_flags(argv: list[str], flags_with_value: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` without ``flags_with_value`` (with their values, spaced or after ``=``) and ``flags``:
    what a benchmark passes on to its other sides."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags_with_value:
            skip = True
        elif a in flags or any(a.startswith(f + "=") for f in flags_with_value):
            continue
        else:
            out.append(a)
    return out
