"""bench.lora's time to first token of a cold LoRA adapter, in the offline engine (its own process).

One engine with ``--max-loras 1`` and ``--max-cpu-loras 2`` over three adapters, so each state is
set by the requests before it (server/worker/lora_manager.py): W warm (resident in the device
slot), H in the host pool only (laid out on the device when used), D in neither (read from its
PEFT directory at admission, then laid out). Per round, untimed H then W (the slot holds W, the
host pool H and W), then timed: W (warm), H (from the host pool), D (from disk); and the base
model's for scale. Each timed request is a fresh prompt of random token ids (nothing in the prefix
cache), one output token; its TTFT is from before ``add_request`` to the step that returns it. The
manager's state before each one and the reads from disk it caused are recorded, so a round that
did not load from where it says fails the run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.lora_engine import _llm, adapter_paths


def side_ttft(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvscale.server.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    paths = adapter_paths(args, 3)
    warm, host, disk = paths
    engine = _llm(args, enable_lora=True, lora_modules=paths, max_loras=1, max_cpu_loras=2,
                  max_lora_rank=args.rank).llm_engine
    manager = engine.runner.lora
    rng = random.Random(args.seed)
    ids = iter(range(1_000_000))

    def first_token(name: str | None) -> dict[str, Any]:
        prompt = [rng.randrange(3, 49152) for _ in range(args.ttft_prompt_tokens)]
        state = {"resident_before": name in manager.resident, "reads_before": manager.reads}
        started = time.perf_counter()
        engine.add_request(f"t{next(ids)}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                           lora_name=name)
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - started
        return {"ttft_s": seconds, "resident_before": state["resident_before"],
                "disk_reads": manager.reads - state["reads_before"]}

    samples: dict[str, list[dict[str, Any]]] = {"warm": [], "host_pool": [], "disk": [], "base": []}
    first_token(None)  # untimed: first-use costs
    for _ in range(args.ttft_rounds):
        first_token(host)
        first_token(warm)
        samples["warm"].append(first_token(warm))
        samples["host_pool"].append(first_token(host))
        samples["disk"].append(first_token(disk))
        samples["base"].append(first_token(None))
    expected = {"warm": (True, 0), "host_pool": (False, 0), "disk": (False, 1), "base": (False, 0)}
    for kind, runs in samples.items():
        for run in runs:
            if (run["resident_before"], run["disk_reads"]) != expected[kind]:
                raise SystemExit(f"lora_ttft: a {kind} request found resident={run['resident_before']} and read "
                                 f"{run['disk_reads']} adapters from disk")
    adapter_bytes = sum(f.stat().st_size for f in Path(paths[disk]).iterdir())
    return {"ttft_ms_median": {kind: 1000 * statistics.median(r["ttft_s"] for r in runs)
                               for kind, runs in samples.items()},
            "ttft_ms": {kind: [1000 * r["ttft_s"] for r in runs] for kind, runs in samples.items()},
            "prompt_tokens": args.ttft_prompt_tokens, "rounds": args.ttft_rounds, "adapter_file_bytes": adapter_bytes}
