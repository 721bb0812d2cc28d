"""Warm-up (run at start-up on a GPU so every Triton kernel is compiled before /health is ready):
it runs prefill, mixed and decode passes and leaves nothing behind that a request could see."""

from __future__ import annotations

import collections
import dataclasses

from kvscale.server.sampling_params import SamplingParams


def test_warm_up_runs_every_attention_path_and_leaves_no_trace(
    make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens, monkeypatch
):
    engine = make_engine()
    calls: collections.Counter = collections.Counter()
    counting = {}
    for name in ("write_kv", "paged_decode_attention", "paged_prefill_attention"):
        inner = getattr(engine.runner.kernels, name)

        def counted(*args, _name=name, _inner=inner, **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)

        counting[name] = counted
    monkeypatch.setattr(engine.runner, "kernels", dataclasses.replace(engine.runner.kernels, **counting))
    engine.runner.warm_up()
    layers = engine.model.spec.num_layers
    assert calls == {"write_kv": 3 * layers, "paged_prefill_attention": 2 * layers,
                     "paged_decode_attention": layers}
    # Nothing cached, announced or counted; requests after it still match transformers.
    assert engine.drain_kv_events() == [] and engine.cached_block_hashes() == []
    assert engine.pool.num_active_blocks == 0
    prompt = greedy_prompts[2]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert run_to_completion(engine)["r"].outputs[0].token_ids == hf_greedy_tokens[prompt]
