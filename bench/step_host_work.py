"""The host's work in one decode step of many sequences, this tree against another checkout's, in
the same run: what paces a GPU's decode step (docs/performance.md, "GPU: the decode
step and the kernels"), measured where no GPU is needed.

The engine runs as its core does under ``kvscale serve`` (async scheduling, delta outputs, no
detokenization) on CPU, over a model of the bundled model's vocabulary and tokenizer but one
layer 64 wide with random weights, so that the forward stays small beside the host's work. Once
every sequence decodes, each step's phases are timed: scheduling, building the step's inputs,
turning the previous step's tokens into outputs; and the step's outputs as they cross from a
core process to the front end (``StepDone`` encoded by the core, decoded by the front end).

    git worktree add --detach /tmp/kv-before HEAD~1
    python -m bench.step_host_work --before-checkout /tmp/kv-before --rounds 3

Each side runs its own tree's engine in its own process, alternating round by round. Writes
``bench/results/step_host_work.json``: every round's medians per phase, and per phase the median
over the rounds and before / after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.before_after import (
    add_before_checkout,
    checkout_of,
    commits,
    median_ratio,
    order,
    run_json,
)
from bench.common import checkout_env, machine, write_result
from bench.roofline import cpu_isa

# Run by each side against its own tree (names both trees have).
MEASURE = """
import json, statistics, time, torch
torch.set_num_threads(1)
try:
    from kvscale.server.engine.engine_core_wire import StepDone, core_codec, front_codec
    from kvscale.server.engine.output_builder import OutputKind
    from kvscale.server.entrypoints.llm import LLM
except ImportError:  # a checkout from before server/ had its layers (docs/architecture.md, "The engine's layers")
    from kvscale.server.engine_core_wire import StepDone, core_codec, front_codec
    from kvscale.server.llm import LLM
    from kvscale.server.output_builder import OutputKind
from kvscale.server.sampling_params import SamplingParams
num_seqs, context, steps, budget = {num_seqs}, {context}, {steps}, 4096
# The first prompts decode while later ones prefill: room for those tokens too.
headroom = steps + 2 * -(-num_seqs * context // (budget - num_seqs)) + 16
llm = LLM(model={model!r}, dtype="float32", device="cpu", max_num_seqs=num_seqs, max_num_batched_tokens=budget,
          max_model_len=context + headroom + 8, num_gpu_blocks_override=num_seqs * ((context + headroom) // 16 + 2),
          async_scheduling=True)
engine = llm.llm_engine
engine.output_kind, engine.detokenize = OutputKind.DELTA, False
params = SamplingParams(temperature=0.0, max_tokens=headroom, ignore_eos=True)
for i in range(num_seqs):
    engine.add_request(str(i), [3 + (i * 7919 + j * 104729) % 40000 for j in range(context)], params)
running = engine.scheduler.running
while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
    engine.step()
times = {{}}
def timed(obj, name, key):
    inner = getattr(obj, name)
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.setdefault(key, []).append(time.perf_counter() - started)
    setattr(obj, name, run)
timed(engine.scheduler, "schedule", "schedule_ms")
timed(engine.runner, "prepare", "prepare_ms")
timed(engine, "_finish_in_flight", "outputs_ms")
core, front = core_codec(), front_codec()
for _ in range(4):
    engine.step()
times.clear()
for _ in range(steps):
    started = time.perf_counter()
    outputs = engine.step()
    times.setdefault("step_ms", []).append(time.perf_counter() - started)
    started = time.perf_counter()
    wire = core.encode(StepDone(outputs, engine.get_stats()))
    times.setdefault("wire_encode_ms", []).append(time.perf_counter() - started)
    started = time.perf_counter()
    front.decode(wire)
    times.setdefault("wire_decode_ms", []).append(time.perf_counter() - started)
    times.setdefault("wire_bytes", []).append(len(wire) / 1000)
assert len(running) == num_seqs, "a sequence ended while timed"
row = {{key: statistics.median(values) * (1 if key == "wire_bytes" else 1000) for key, values in times.items()}}
row["host_ms"] = row["schedule_ms"] + row["prepare_ms"] + row["outputs_ms"]
print(json.dumps(row))
"""


def tiny_model(directory: Path) -> Path:
    """The bundled model's tokenizer and vocabulary, one layer 64 wide, random weights."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvscale.model_files import resolve_model_path

    source = resolve_model_path(None)
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, directory / item.name)
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)
    (directory / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).save_pretrained(directory)
    return directory


def measure(checkout: Path, model: Path, num_seqs: int, context: int, steps: int) -> dict:
    env = checkout_env(checkout, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    code = MEASURE.format(model=str(model), num_seqs=num_seqs, context=context, steps=steps)
    return run_json([sys.executable, "-c", code], checkout, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_before_checkout(parser, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvscale-tiny-model-") as scratch:
        model = tiny_model(Path(scratch))
        for round_id in range(args.rounds):
            entry: dict = {"order": order(round_id)}
            for side in entry["order"]:
                entry[side] = measure(checkout_of(side, args.before_checkout), model, args.num_seqs, args.context,
                                      args.steps)
                print(f"round {round_id} {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry[side].items()),
                      flush=True)
            rounds.append(entry)
    summary = {}
    for key in rounds[0]["after"]:
        summary[key] = median_ratio(rounds, lambda side, key=key: side[key])
        print(f"{key}: before {summary[key]['before']:.3f}, after {summary[key]['after']:.3f}, "
              f"{summary[key]['before_over_after']:.2f}x")
    result = {"benchmark": "step_host_work", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {**machine(), "isa": cpu_isa()}, "num_seqs": args.num_seqs, "context": args.context,
              "steps": args.steps, "commits": commits(args.before_checkout),
              "rounds": rounds, "summary": summary}
    print(write_result("step_host_work", result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
