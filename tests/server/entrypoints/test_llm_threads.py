"""The offline ``LLM`` pins torch's OpenMP threads one per CPU on the CPU (server/entrypoints/llm.py,
kernels/cpu_threads.c). Each check runs in a child process: pinning the test process's own
thread would also pin every server later tests start from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, torch
torch.set_num_threads(2)
from kvscale.server.entrypoints.llm import pin_cpu_threads
used = pin_cpu_threads()
torch.ones(1 << 20).sum()  # a parallel region after pinning: the pool keeps its threads
tasks = {t: os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
print(json.dumps({"used": used, "main": sorted(os.sched_getaffinity(0)),
                  "pinned": sorted(sorted(c) for c in tasks.values() if len(c) == 1)}))
"""


def run_child(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs; CI has two")
def test_two_threads_pinned_to_two_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    result = run_child()
    assert result["used"] == cpus
    assert result["main"] == cpus[:1]  # the calling thread is the pool's first
    assert sorted({p[0] for p in result["pinned"]}) == cpus  # one pool thread on each


def test_nobind_leaves_threads_alone() -> None:
    result = run_child(KVSCALE_CPU_OMP_THREADS_BIND="nobind")
    assert result["used"] == []
    assert result["main"] == sorted(os.sched_getaffinity(0))
