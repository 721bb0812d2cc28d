"""Process helpers: the start-up heap freeze that keeps full GCs off the serving path."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import gc, json
from kvscale.processes import freeze_startup_heap
startup = [[i] for i in range(200_000)]  # stands in for torch/transformers' objects
before = len(gc.get_objects())
freeze_startup_heap()
after = len(gc.get_objects())
garbage = []
garbage.append(garbage)  # a cycle made after start-up is still collected
del garbage
print(json.dumps({"before": before, "after": after, "frozen": gc.get_freeze_count(),
                  "collected": gc.collect()}))
"""


def test_freeze_startup_heap_leaves_full_collections_only_new_objects():
    # A child process: freezing pytest's own heap would keep every later test's garbage.
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    counts = json.loads(probe.stdout)
    assert counts["before"] > 200_000
    assert counts["frozen"] >= 200_000
    # What a full collection walks now: a few objects, not the start-up heap.
    assert counts["after"] < counts["before"] // 20
    assert counts["collected"] >= 1
