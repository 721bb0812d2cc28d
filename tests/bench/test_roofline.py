"""The machine probes the benchmarks record beside their figures (bench/roofline.py)."""

from __future__ import annotations

import torch

from bench.roofline import memory_stream


def test_memory_stream_reads_the_buffer_it_names() -> None:
    before = torch.get_num_threads()
    probe = memory_stream(1, mib=16, seconds=0.05)
    try:
        assert probe["bytes"] == 16 * 1024 * 1024 and probe["threads"] == 1 and probe["runs"] >= 3
        # Any machine this runs on reads between 100 MB/s and 10 TB/s; a probe that timed nothing
        # (or divided wrong) lands outside.
        assert 0.1 < probe["median_gbps"] <= probe["best_gbps"] < 10_000
    finally:
        torch.set_num_threads(before)
