"""Each process's metrics object exports every name the contract (kvscale/metric_names.py) lists
for it, with the documented labels; the rules behind the new counters (spills, evictions, scale
decisions) are checked as pure functions."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscale import metric_names as names
from kvscale.operator.metrics import OperatorMetrics, ReplicaCounts, scale_direction
from kvscale.operator.scaling import LoadEstimate, ScaleDecision
from kvscale.operator.spec import AutoscalingPolicy
from kvscale.router.metrics import RouterMetrics, is_spill
from kvscale.server.core.block_pool import BlockPool
from kvscale.server.entrypoints.metrics import HTTPStatusMiddleware, ServerMetrics
from kvscale.server.outputs import EngineStats


def samples(text: bytes) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def assert_exports(text: bytes, metrics: tuple[names.Metric, ...]) -> dict:
    found = samples(text)
    for metric in metrics:
        for sample_name in names.exposed_sample_names(metric):
            assert sample_name in found, f"{sample_name} missing from /metrics"
        labels = set(found[names.exposed_sample_names(metric)[0]][0]) - {"le"}
        assert labels == set(metric.labels), (metric.name, labels)
    return found


def test_contract_names_are_unique_and_prefixed() -> None:
    all_names = [m.name for m in names.ALL_METRICS]
    assert len(all_names) == len(set(all_names))
    assert all(m.name.startswith(("vllm:", "kvscale:")) for m in names.SERVER_METRICS)
    assert all(m.name.startswith("kvscale_router_") for m in names.ROUTER_METRICS)
    assert all(m.name.startswith("kvscale_operator_") for m in names.OPERATOR_METRICS)
    assert names.PROMPT_TOKENS.series == "vllm:prompt_tokens_total"
    assert names.TTFT.bucket == "vllm:time_to_first_token_seconds_bucket"


def stats(**overrides) -> EngineStats:
    base = dict(num_running=1, num_waiting=2, kv_blocks_total=64, kv_blocks_active=8,
                kv_blocks_cached=4, block_size=16, prefix_cache_queries=100,
                prefix_cache_hits=40, num_preemptions=0,
                extra={"kv_blocks_evicted_total": 3.0, "enable_prefix_caching": 1.0})
    return EngineStats(**{**base, **overrides})


def test_server_metrics_export_the_contract_and_cache_config_info() -> None:
    metrics = ServerMetrics("m", lambda: stats())
    metrics.ttft.observe(0.1)
    metrics.itl.observe(0.01)
    metrics.e2e.observe(0.5)
    metrics.queue_time.observe(0.0)
    found = assert_exports(metrics.render(), names.SERVER_METRICS)
    assert found[names.CACHE_CONFIG_INFO.series] == [
        {"model_name": "m", "block_size": "16", "num_gpu_blocks": "64",
         "enable_prefix_caching": "True", "cache_dtype": "auto"}]
    text = metrics.render().decode()
    assert "kvscale:kv_blocks_evicted_total{model_name=\"m\"} 3.0" in text


def test_server_metrics_carry_the_queued_prefill_work_and_the_measured_rate() -> None:
    # What the autoscaler divides: seconds of prompt work queued on the replica.
    extra = {"prefill_tokens_waiting": 1024.0, "prefill_tokens_per_s": 256.0}
    text = ServerMetrics("m", lambda: stats(extra=extra)).render().decode()
    assert 'kvscale:prefill_tokens_waiting{model_name="m"} 1024.0' in text
    assert 'kvscale:prefill_tokens_per_s{model_name="m"} 256.0' in text


def test_http_status_middleware_counts_by_route_and_status() -> None:
    metrics = ServerMetrics("m", lambda: None)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        pass

    wrapped = HTTPStatusMiddleware(app, metrics)
    for path in ("/v1/completions", "/v1/completions", "/random/path"):
        asyncio.run(wrapped({"type": "http", "path": path}, None, send))
    value = metrics.registry.get_sample_value
    assert value(names.HTTP_REQUESTS.series,
                 {"model_name": "m", "route": "/v1/completions", "status": "401"}) == 2
    assert value(names.HTTP_REQUESTS.series,
                 {"model_name": "m", "route": "other", "status": "401"}) == 1


def test_block_pool_counts_evictions_of_cached_prefixes_only() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    a, b = pool.allocate(), pool.allocate()
    pool.register_full_block(a, 111, None)
    pool.register_full_block(b, 222, 111)
    pool.free([b, a])
    pool.allocate()  # the fresh block: nothing evicted
    assert pool.num_evicted == 0
    pool.allocate()  # only cached blocks left: one prefix goes
    assert pool.num_evicted == 1
    assert len(pool.cached_hashes()) == 1


def test_router_metrics_export_the_contract() -> None:
    metrics = RouterMetrics("prefix-affinity")
    metrics.requests.labels("r0", "prefix-affinity", "200").inc()
    metrics.decision_seconds.observe(0.001)
    metrics.predicted_hit_tokens_per_request.observe(16)
    metrics.in_flight.labels("r0").set(0)
    metrics.index_blocks.labels("r0").set(3)
    metrics.tokenizer_loaded.labels("smollm2-135m-instruct").set(1)
    assert_exports(generate_latest(metrics.registry), names.ROUTER_METRICS)


def test_spill_is_passing_over_the_best_cache_for_load() -> None:
    assert is_spill({"a": 4, "b": 0}, "b", "load")
    assert not is_spill({"a": 4, "b": 0}, "a", "affinity")
    assert not is_spill({"a": 0, "b": 0}, "b", "load")  # nothing cached anywhere
    assert not is_spill({"a": 4, "b": 0}, "b", "sticky")  # the client asked for b
    assert is_spill({"a": 4, "b": 2}, "b", "affinity")


def test_operator_metrics_export_the_contract_and_count_only_changes() -> None:
    metrics = OperatorMetrics()
    policy = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=3)
    estimate = LoadEstimate(load=2.4, kv_usage=0.8, occupancy=0.8, waiting=1, reported=1, pods=1)
    up = ScaleDecision(2, "ScaleUp", "", estimate, panic=True)
    metrics.observe("u1", "ns", "chat", policy, ReplicaCounts(2, 1, 1), estimate, up, previous=1)
    stable = ScaleDecision(2, "Stable", "", estimate)
    metrics.observe("u1", "ns", "chat", policy, ReplicaCounts(2, 2, 2), estimate, stable, 2)
    metrics.error("u1", "ns", "chat", "reconcile")
    metrics.observe_activation("u1", "ns", "chat", held=3, cold_start_s=7.5)
    assert_exports(metrics.render(), names.OPERATOR_METRICS)
    value = metrics.registry.get_sample_value
    key = {"namespace": "ns", "inferenceservice": "chat"}
    assert value(names.OPERATOR_SCALE_DECISIONS.series,
                 {**key, "direction": "up", "reason": "ScaleUp"}) == 1
    assert value(names.OPERATOR_SCALE_DECISIONS.series,
                 {**key, "direction": "down", "reason": "ScaleDown"}) == 0
    assert value(names.OPERATOR_LOAD.series, key) == 2.4
    assert value(names.OPERATOR_PANIC.series, key) == 0
    assert value(names.OPERATOR_MAX.series, key) == 3
    # Scaled by hand: no bounds, so KVScaleAutoscalerAtMaxReplicas cannot fire for it.
    manual = AutoscalingPolicy(enabled=False, max_replicas=4)
    metrics.observe("u1", "ns", "chat", manual, ReplicaCounts(5, 5, 5), None, None, previous=5)
    assert value(names.OPERATOR_MAX.series, key) is None and value(names.OPERATOR_MIN.series, key) is None
    assert value(names.OPERATOR_DESIRED.series, key) == 5
    metrics.observe("u1", "ns", "chat", policy, ReplicaCounts(2, 2, 2), estimate, stable, 2)
    assert scale_direction(2, 2) is None and scale_direction(1, 3) == "up"
    # Registered at reconcile: every decision series reads 0 before the first decision.
    metrics.register("u2", "ns", "new")
    assert value(names.OPERATOR_SCALE_DECISIONS.series, {
        "namespace": "ns", "inferenceservice": "new", "direction": "up", "reason": "Panic"}) == 0
    metrics.forget("u1")
    assert value(names.OPERATOR_LOAD.series, key) is None
    assert value(names.OPERATOR_SCALE_DECISIONS.series,
                 {**key, "direction": "up", "reason": "ScaleUp"}) is None


def test_operator_metrics_show_the_queued_prefill_seconds_against_their_target() -> None:
    """The load's second measure gets its own series, set on every run that has an estimate."""
    metrics = OperatorMetrics()
    policy = AutoscalingPolicy(enabled=True, max_replicas=8, target_prefill_seconds=2.0)
    estimate = LoadEstimate(load=3.2, kv_usage=0.1, occupancy=0.5, waiting=2, reported=2, pods=2,
                            prefill_seconds=6.4)
    decision = ScaleDecision(2, "ScaleUp", "", estimate)
    metrics.observe("u1", "ns", "chat", policy, ReplicaCounts(2, 1, 1), estimate, decision, 1)
    value = metrics.registry.get_sample_value
    key = {"namespace": "ns", "inferenceservice": "chat"}
    assert value(names.OPERATOR_PREFILL_SECONDS.series, key) == 6.4
    assert value(names.OPERATOR_TARGET_PREFILL_SECONDS.series, key) == 2.0
    # A run without an estimate (no pod reported) keeps the last value rather than a false 0.
    metrics.observe("u1", "ns", "chat", policy, ReplicaCounts(2, 2, 0), None, None, 2)
    assert value(names.OPERATOR_PREFILL_SECONDS.series, key) == 6.4
    metrics.forget("u1")
    assert value(names.OPERATOR_PREFILL_SECONDS.series, key) is None
    assert value(names.OPERATOR_TARGET_PREFILL_SECONDS.series, key) is None


def test_host_tier_metrics_come_from_the_engine_stats() -> None:
    # Usage counts every slot not free: the 5 whose promotion's copy has not run yet too.
    extra = {"kv_host_blocks_total": 100.0, "kv_host_blocks_cached": 25.0, "kv_host_blocks_used": 30.0,
             "kv_blocks_demoted_total": 7.0,
             "kv_offload_bytes_cpu_to_gpu": 4096.0, "kv_offload_seconds_gpu_to_cpu": 0.5,
             "external_prefix_cache_hits_total": 64.0, "kv_restore_seconds_le_0.001": 2.0,
             "kv_restore_seconds_le_1": 3.0, "kv_restore_seconds_count": 3.0, "kv_restore_seconds_sum": 0.2}
    text = ServerMetrics("m", lambda: stats(extra=extra)).render().decode()
    assert 'vllm:cpu_cache_usage_perc{model_name="m"} 0.3' in text
    assert 'kvscale:kv_host_blocks_cached{model_name="m"} 25.0' in text
    assert 'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} 4096.0' in text
    assert 'vllm:kv_offload_total_time_total{model_name="m",transfer_type="GPU_to_CPU"} 0.5' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 64.0' in text
    assert 'kvscale:kv_blocks_demoted_total{model_name="m"} 7.0' in text
    assert 'kvscale:kv_restore_seconds_bucket{le="0.001",model_name="m"} 2.0' in text
    assert 'kvscale:kv_restore_seconds_count{model_name="m"} 3.0' in text


def test_server_metrics_carry_the_speculative_decoding_counters_under_vllms_names() -> None:
    extra = {"spec_decode_num_drafts_total": 5.0, "spec_decode_num_draft_tokens_total": 20.0,
             "spec_decode_num_accepted_tokens_total": 12.0}
    text = ServerMetrics("m", lambda: stats(extra=extra)).render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
