"""A replica's second KV tier as the router sees it: KV events with their tier on the wire, the
index's per-replica host set, and the predicted-TTFT estimate pricing a tier-2 hit at its restore
cost (cheaper than prefill, dearer than a tier-1 hit)."""

from __future__ import annotations

from kvscale.kv_index_schema import REMOVED, STORED, TIER_HOST, event_tier
from kvscale.router import policy as routing
from kvscale.router.config import RouterConfig
from kvscale.router.decision import Decider
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.replicas import Replica
from kvscale.server.engine.kv_publisher import encode_events
from kvscale.server.outputs import BlockRemoved, BlockStored


def test_events_carry_the_tier_only_when_it_is_the_host_tier():
    encoded = encode_events([BlockRemoved([5]), BlockStored([5], 4, 16, tier=TIER_HOST), BlockStored([6], 5, 16)])
    assert encoded == [[REMOVED, [5]], [STORED, [5], TIER_HOST], [STORED, [6]]]
    assert [event_tier(e) for e in encoded] == [1, 2, 1]


def test_index_follows_blocks_between_tiers():
    index = PrefixIndex()
    index.stored("r", [1, 2, 3])
    # demotion of 1 and 2: removed from tier 1, stored in tier 2
    index.removed("r", [1, 2])
    index.stored("r", [1, 2], TIER_HOST)
    matched = index.match([1, 2, 3, 4], ["r"], now=0.0)
    assert matched == {"r": 3}
    assert index.match_host([1, 2, 3, 4], matched) == {"r": 2}
    # promotion of 1; drop of 2 from tier 2
    index.removed("r", [1])
    index.stored("r", [1])
    index.removed("r", [2])
    matched = index.match([1, 2, 3], ["r"], now=0.0)
    assert matched == {"r": 1} and index.match_host([1, 2, 3], matched) == {"r": 0}


def test_a_tier_two_hit_costs_its_restore_between_a_tier_one_hit_and_a_prefill():
    prompt, bs = 2048, 16
    blocks = prompt // bs - 1
    tier1 = routing.Candidate("a", 0, matched_blocks=blocks, prefill_tokens_per_s=1000)
    tier2 = routing.Candidate("b", 0, matched_blocks=blocks, host_blocks=blocks, prefill_tokens_per_s=1000)
    cold = routing.Candidate("c", 0, prefill_tokens_per_s=1000)
    t1, t2, t0 = (routing.predicted_ttft(c, prompt, bs) for c in (tier1, tier2, cold))
    assert t1 < t2 < t0
    assert abs(t2 - t1 - blocks * bs / routing.HOST_RESTORE_SPEEDUP / 1000) < 1e-9


def test_the_decider_prefers_the_tier_one_holder_then_the_tier_two_holder():
    metrics = RouterMetrics("predicted-ttft")
    decider = Decider(RouterConfig(policy="predicted-ttft", seed=0), PrefixIndex(), HeartbeatTable(),
                      InFlight(metrics.in_flight), metrics)
    replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(3)]
    hashes = list(range(100, 164))
    decider.index.stored("r1", hashes, TIER_HOST)
    decider.index.stored("r2", hashes)
    decision = decider.decide(replicas, hashes, hashes[0], None, prompt_tokens=64 * 16 + 5)
    assert decision.ranked[:2] == ["r2", "r1"]
    decider.index.removed("r2", hashes)  # r2 dropped it: the host-tier holder beats a cold prefill
    decision = decider.decide(replicas, hashes, hashes[0], None, prompt_tokens=64 * 16 + 5)
    assert decision.ranked[0] == "r1" and decision.matched_blocks == 64
