"""Kernel checks run by Triton's interpreter in a child process.

``TRITON_INTERPRET=1`` is read when a kernel is decorated, so setting it inside the pytest process
would turn every other test's kernels (the engine's, on a GPU machine) into interpreted ones. One
child runs all of a script's cases and prints one JSON line per case; the tests assert on shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(script: str, args: list[str]) -> list[dict]:
    """The JSON lines ``script`` (beside this file) prints under the interpreter on the CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_FORCE_TRITON="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, str(Path(__file__).with_name(script)), "--device", "cpu", *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # A failing comparison exits 1 and is reported per test; anything else is a crash.
    assert proc.returncode in (0, 1) and results, (
        f"checks exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results
