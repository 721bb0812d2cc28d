"""`kvscale serve --kv-offloading-size`: a prompt evicted from the KV cache comes back from the
host tier over the real HTTP API (official `openai` client), with the same greedy text, and the
tier's metrics say so."""

from __future__ import annotations

import openai
import pytest

from tests.server.api_helpers import ServeProcess, scrape, wait_for_idle_pool

pytestmark = pytest.mark.slow


def prompt(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 40000 + 100 for i in range(n)]


def test_an_evicted_prefix_is_promoted_back_over_http():
    server = ServeProcess("--num-gpu-blocks-override", "16", "--kv-offloading-size", "0.02",
                          log_name="kv-tier")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(tokens: list[int]) -> str:
            out = client.completions.create(model=model, prompt=tokens, max_tokens=4, temperature=0)
            return out.choices[0].text

        a = prompt(1, 96)
        complete(a)
        # a again from the device cache: its last block is recomputed over the cached blocks. The
        # promoted run below does exactly that arithmetic over the blocks' bytes after their trip
        # to the host tier, so its greedy text must be the same; the first run's is not (its
        # GEMMs had 96 rows, not 16, and bf16 results depend on the blocking).
        cached = complete(a)
        complete(prompt(5000, 240))  # fills the 16-block cache: a's blocks go down to the host tier
        before = scrape(server.base_url)
        assert before["kvscale:kv_blocks_demoted_total"] >= 6
        assert complete(a) == cached
        after = wait_for_idle_pool(server.base_url)
        assert after["kvscale:kv_blocks_promoted_total"] >= 5  # the last block is always recomputed
        assert after["vllm:external_prefix_cache_hits_total"] >= 5 * 16
        assert after["kvscale:kv_host_blocks_total"] > 0 and after["vllm:cpu_cache_usage_perc"] > 0
        assert after["vllm:kv_offload_total_bytes_total{transfer_type=CPU_to_GPU}"] > 0
        assert after["kvscale:kv_restore_seconds_count"] >= 1
        assert after["kvscale:kv_blocks_active"] == 0  # nothing held once idle
    finally:
        server.stop()
