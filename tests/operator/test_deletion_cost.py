"""What a scale-in would lose, as the pod-deletion-cost (operator/deletion_cost.py), and when it
is worth a PATCH."""

from __future__ import annotations

from kvscale.operator.deletion_cost import (
    DELETION_COST_ANNOTATION,
    costs_to_write,
    pod_cost,
    worth_patching,
)
from kvscale.operator.scaling import PodLoad


def test_an_idle_pod_with_a_warm_cache_costs_more_than_a_busy_cold_one() -> None:
    warm_idle = pod_cost(active_blocks=0, cached_blocks=300)
    busy_cold = pod_cost(active_blocks=40, cached_blocks=0)
    assert warm_idle == 300 and busy_cold == 80 and warm_idle > busy_cold
    # A cache no router's index points at any more is worth nothing to keep.
    assert pod_cost(0, 300, indexed_blocks=0) == 0
    # The index holds active and cached blocks alike: only what is past the active ones counts.
    assert pod_cost(40, 300, indexed_blocks=140) == 80 + 100


def test_only_a_meaningful_change_is_patched() -> None:
    assert worth_patching(None, 0) and worth_patching("garbage", 5)
    assert not worth_patching("100", 110)   # 10 blocks: noise under load
    assert not worth_patching("1000", 1100)  # 100 blocks but 9 %
    assert worth_patching("100", 130)
    assert worth_patching("0", 16) and not worth_patching("0", 15)


def pod(name: str, cost: str | None) -> dict:
    annotations = {DELETION_COST_ANNOTATION: cost} if cost is not None else {}
    return {"metadata": {"name": name, "namespace": "ns", "annotations": annotations}}


def test_every_scrape_under_steady_load_writes_nothing_new() -> None:
    pods = [pod("a", "200"), pod("b", None), pod("c", "50")]
    loads = [PodLoad("a", kv_blocks_active=100, kv_blocks_total=1000, kv_blocks_cached=4),
             PodLoad("b", kv_blocks_active=10, kv_blocks_total=1000, kv_blocks_cached=0),
             PodLoad("c", error="scrape timed out")]
    # b had none; a moved by 4 blocks; c said nothing.
    assert costs_to_write(pods, loads) == {"b": 20}
    # The routers' index no longer points at a's cache: its cost halves, worth a write.
    assert costs_to_write(pods, loads[:1], indexed={"a": 0.0}) == {}  # 200 -> 200: live only
    assert costs_to_write([pod("a", "400")], loads[:1], indexed={"a": 0.0}) == {"a": 200}
