"""Decode steps through the graph path's static buffers (server/worker/decode_graphs.py).

CUDA graphs need a GPU; here the capture is replaced by rerunning the captured forward, so what
a replay reads is exactly what the static buffers hold: the step's inputs copied in, the padding
rows masked. ``python -m bench.gpu_engine --parts graphs`` checks the real capture on a GPU.
"""

from __future__ import annotations

import torch

from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.decode_graphs import capture_sizes, padded_size


def rerunning(replayed: list[int]):
    """A capture that reruns the forward on replay, noting the batch size it replays."""

    def capture(forward):
        def replay() -> torch.Tensor:
            replayed.append(forward.args[0])
            return forward()

        return replay

    return capture


def test_capture_sizes_follow_the_ladder_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]


def test_padded_size_is_the_smallest_captured_size_that_fits() -> None:
    sizes = capture_sizes(20)
    assert [padded_size(sizes, n) for n in (1, 3, 4, 5, 9, 17, 20, 21)] == [1, 4, 4, 8, 16, 20, 20, None]


def test_a_padded_replay_gives_the_eager_step_and_writes_only_its_own_slots(make_engine) -> None:
    engine = make_engine(max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid, length in (("a", 5), ("b", 20), ("c", 37)):
        engine.add_request(rid, list(range(100 + length, 100 + 2 * length)), params)
    engine.step()  # all three prefill in one step; the next step is pure decode
    scheduled = engine.scheduler.schedule().scheduled
    assert [s.num_new_tokens for s in scheduled] == [1, 1, 1]
    runner = engine.runner
    before = runner.kv_cache.clone()
    eager = runner.execute(scheduled, []).sample.clone()
    after_eager = runner.kv_cache.clone()

    replayed: list[int] = []
    runner.capture_decode_graphs(8, capture=rerunning(replayed))
    assert sorted(runner.decode_graphs._replays) == [1, 2, 4, 8]
    runner.kv_cache.copy_(before)
    graphed = runner.execute(scheduled, []).sample
    assert replayed == [4], "three sequences should replay the graph of four"
    assert graphed.shape == eager.shape
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(graphed.argmax(dim=1), eager.argmax(dim=1))
    # The step wrote its three tokens' K/V, and the padded row wrote nothing anywhere.
    written = torch.zeros(runner.kv_cache.shape[2] * runner.kv_cache.shape[3], dtype=torch.bool)
    for item in scheduled:
        position = item.seq.num_computed_tokens
        written[item.seq.block_table[position // engine.block_size] * engine.block_size + position % engine.block_size] = True
    flat = runner.kv_cache.flatten(2, 3)
    assert torch.equal(flat[:, :, ~written], before.flatten(2, 3)[:, :, ~written])
    torch.testing.assert_close(flat[:, :, written], after_eager.flatten(2, 3)[:, :, written], rtol=1e-4, atol=1e-4)
    for rid in ("a", "b", "c"):
        engine.abort_request(rid)


def test_more_sequences_than_captured_run_eagerly(make_engine) -> None:
    engine = make_engine(max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), list(range(200 + i, 210 + i)), params)
    engine.step()
    replayed: list[int] = []
    engine.runner.capture_decode_graphs(2, capture=rerunning(replayed))  # sizes 1 and 2 only
    while engine.has_unfinished_requests():
        engine.step()
    assert replayed == [], "three sequences do not fit a graph of two"


def test_enforce_eager_has_vllms_spelling_and_reaches_the_engine_config() -> None:
    import argparse

    from kvscale.server.config import EngineConfig
    from kvscale.server.entrypoints import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([]).enforce_eager is None  # unset: EngineConfig's False (graphs on a GPU)
    assert "enforce_eager" in cli_serve._ENGINE_FIELDS and EngineConfig().enforce_eager is False


def test_a_cpu_engine_captures_no_graphs(make_engine) -> None:
    assert make_engine().runner.decode_graphs is None
