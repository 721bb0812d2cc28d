"""Every Prometheus metric kvscale exports, in one place: name, type, labels and meaning.

The servers, the router and the operator register their metrics from these definitions; the
operator's scraper, the dashboards generator, the alerting rules and the tests read the names from
here too, so a rename is one edit and a dashboard can never query a name nobody exports.
docs/observability.md lists them (a test keeps that list complete).

`Metric.name` is what a process registers; `Metric.series` is what PromQL selects (a counter's
samples carry `_total`), `Metric.bucket` a histogram's buckets. Importing this module pulls in
nothing but the standard library (the operator and the chart tooling run without torch). Over
400 lines on purpose: one registry, so that a name is defined once for every part that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()

    @property
    def series(self) -> str:
        """The sample name a query uses for the value (counters: `_total`)."""
        return f"{self.name}_total" if self.type == COUNTER else self.name

    @property
    def bucket(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return f"{self.name}_bucket"

    @property
    def sum(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return f"{self.name}_sum"

    @property
    def count(self) -> str:
        assert self.type == HISTOGRAM, self.name
        return f"{self.name}_count"


_M = ("model_name",)

# --- kvscale serve (vLLM's names where vLLM has the metric) ---------------------------------
NUM_REQUESTS_RUNNING = Metric("vllm:num_requests_running", GAUGE, "Requests in the running batch.", _M)
NUM_REQUESTS_WAITING = Metric(
    "vllm:num_requests_waiting", GAUGE, "Requests waiting to be scheduled.", _M)
KV_CACHE_USAGE = Metric(
    "vllm:kv_cache_usage_perc", GAUGE,
    "KV cache usage as a fraction in [0, 1]: blocks held by live requests / all blocks.", _M)
PREFIX_CACHE_QUERIES = Metric(
    "vllm:prefix_cache_queries", COUNTER, "Prompt tokens looked up in the prefix cache.", _M)
PREFIX_CACHE_HITS = Metric(
    "vllm:prefix_cache_hits", COUNTER, "Prompt tokens found in the prefix cache.", _M)
NUM_PREEMPTIONS = Metric(
    "vllm:num_preemptions", COUNTER, "Preemptions of running requests.", _M)
PROMPT_TOKENS = Metric("vllm:prompt_tokens", COUNTER, "Prompt tokens processed.", _M)
GENERATION_TOKENS = Metric("vllm:generation_tokens", COUNTER, "Tokens generated.", _M)
REQUEST_SUCCESS = Metric(
    "vllm:request_success", COUNTER, "Finished requests by finish reason.",
    ("model_name", "finished_reason"))
TTFT = Metric("vllm:time_to_first_token_seconds", HISTOGRAM, "Time to first token.", _M)
ITL = Metric(
    "vllm:inter_token_latency_seconds", HISTOGRAM, "Time between successive output tokens.", _M)
E2E_LATENCY = Metric("vllm:e2e_request_latency_seconds", HISTOGRAM, "Arrival to finish.", _M)
QUEUE_TIME = Metric(
    "vllm:request_queue_time_seconds", HISTOGRAM, "Arrival to first scheduled.", _M)
# vLLM's info gauge (value 1) whose labels carry the cache geometry; the Gateway API Inference
# Extension reads num_gpu_blocks and block_size from it.
CACHE_CONFIG_INFO = Metric(
    "vllm:cache_config_info", GAUGE, "KV cache configuration (value 1; the labels carry it).",
    ("model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"))
# vLLM's LoRA info gauge: the adapters of the running and the waiting requests (comma-separated,
# sorted) and --max-loras in its labels, the time of the snapshot (Unix seconds) as its value.
# One series at a time (the current one). --max-loras 0: LoRA is off.
LORA_REQUESTS_INFO = Metric(
    "vllm:lora_requests_info", GAUGE, "Running stats on LoRA requests (value: the snapshot's Unix time).",
    ("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
KV_BLOCKS_TOTAL = Metric("kvscale:kv_blocks_total", GAUGE, "KV cache blocks in the pool.", _M)
KV_BLOCKS_ACTIVE = Metric(
    "kvscale:kv_blocks_active", GAUGE,
    "KV blocks held by live (running or preempted-and-holding) requests; not reclaimable.", _M)
KV_BLOCKS_CACHED = Metric(
    "kvscale:kv_blocks_cached", GAUGE,
    "Free KV blocks still holding a reusable prefix; evicted on demand, so free capacity.", _M)
MAX_NUM_SEQS = Metric(
    "kvscale:max_num_seqs", GAUGE,
    "Sequences the engine batches at once at most (--max-num-seqs): the batch slots.", _M)
# The autoscaler's prefill signal: queued prompt work in seconds is the first over the second.
PREFILL_TOKENS_WAITING = Metric(
    "kvscale:prefill_tokens_waiting", GAUGE,
    "Prompt tokens queued or mid-prefill that the engine must still compute (cached prefixes excluded).", _M)
PREFILL_TOKENS_PER_S = Metric(
    "kvscale:prefill_tokens_per_s", GAUGE,
    "Measured prefill rate: moving average over recent steps that prefilled; 0 until measured.", _M)
KV_BLOCKS_EVICTED = Metric(
    "kvscale:kv_blocks_evicted", COUNTER,
    "Cached KV blocks whose prefix was dropped to make room for new data.", _M)
# The second KV tier (host memory, --kv-offloading-size): vLLM's offloading names where vLLM has
# the metric (transfer_type "GPU_to_CPU" is a demotion, "CPU_to_GPU" a promotion, whatever the
# device), kvscale's own for the rest. All are exported, as zeros, with no second tier.
_T = ("model_name", "transfer_type")
KV_OFFLOAD_BYTES = Metric(
    "vllm:kv_offload_total_bytes", COUNTER, "Bytes copied between the KV cache and the host tier.", _T)
KV_OFFLOAD_TIME = Metric(
    "vllm:kv_offload_total_time", COUNTER, "Seconds spent copying between the KV cache and the host tier.", _T)
EXTERNAL_PREFIX_CACHE_QUERIES = Metric(
    "vllm:external_prefix_cache_queries", COUNTER,
    "Prompt tokens looked up in the host tier (those the KV cache itself did not hold).", _M)
EXTERNAL_PREFIX_CACHE_HITS = Metric(
    "vllm:external_prefix_cache_hits", COUNTER, "Prompt tokens found in the host tier (promoted).", _M)
CPU_CACHE_USAGE = Metric(
    "vllm:cpu_cache_usage_perc", GAUGE, "Host KV tier usage as a fraction in [0, 1]: slots not free (a block, or one waiting for its copy up).", _M)
KV_HOST_BLOCKS_TOTAL = Metric("kvscale:kv_host_blocks_total", GAUGE, "Blocks of the host KV tier.", _M)
KV_HOST_BLOCKS_CACHED = Metric(
    "kvscale:kv_host_blocks_cached", GAUGE, "Host KV tier blocks holding a findable prefix block.", _M)
KV_BLOCKS_DEMOTED = Metric(
    "kvscale:kv_blocks_demoted", COUNTER, "KV blocks copied down to the host tier instead of dropped.", _M)
KV_BLOCKS_PROMOTED = Metric(
    "kvscale:kv_blocks_promoted", COUNTER, "KV blocks copied back up from the host tier on a prefix hit.", _M)
KV_PREEMPTIONS_SWAPPED = Metric(
    "kvscale:kv_preemptions_swapped", COUNTER,
    "Preemptions whose blocks went down to the host tier (the rest are recomputed).", _M)
KV_RESTORE_SECONDS = Metric(
    "kvscale:kv_restore_seconds", HISTOGRAM, "Time of one step's batch of promotions from the host tier.", _M)
HTTP_REQUESTS = Metric(
    "kvscale:http_requests", COUNTER, "HTTP requests answered, by route and status code.",
    ("model_name", "route", "status"))

# Structured outputs and tool calling (server/structured_outputs, server/tool_parsers).
STRUCTURED_REQUESTS = Metric(
    "kvscale:structured_output_requests", COUNTER,
    "Constrained requests, by kind (json, json_object, regex, choice, grammar, tool).",
    ("model_name", "kind"))
STRUCTURED_COMPILE_SECONDS = Metric(
    "kvscale:structured_output_compile_seconds", HISTOGRAM,
    "Time to compile a request's grammar (cache misses only).", _M)
STRUCTURED_COMPILE_CACHE_HITS = Metric(
    "kvscale:structured_output_compile_cache_hits", COUNTER,
    "Constrained requests whose grammar was already compiled.", _M)
STRUCTURED_REFUSALS = Metric(
    "kvscale:structured_output_refusals", COUNTER,
    "Constrained requests refused, by reason (unsupported, timeout, invalid: a 400; wait_timeout: a 503).",
    ("model_name", "reason"))
STRUCTURED_MASK_SECONDS = Metric(
    "kvscale:structured_output_mask_seconds", COUNTER,
    "Time spent filling and applying grammar bitmasks (divide by mask_steps for time per step).", _M)
STRUCTURED_MASK_STEPS = Metric(
    "kvscale:structured_output_mask_steps", COUNTER, "Steps that applied a grammar bitmask.", _M)
STRUCTURED_FORCED_TOKENS = Metric(
    "kvscale:structured_output_forced_tokens", COUNTER,
    "Output tokens the grammar forced, appended without a sampling step (fast-forward).", _M)
# vLLM's speculative decoding counters (--speculative-config; 0 without it).
SPEC_DECODE_NUM_DRAFTS = Metric(
    "vllm:spec_decode_num_drafts", COUNTER, "Sequence steps that verified a draft.", _M)
SPEC_DECODE_NUM_DRAFT_TOKENS = Metric(
    "vllm:spec_decode_num_draft_tokens", COUNTER, "Draft tokens verified.", _M)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = Metric(
    "vllm:spec_decode_num_accepted_tokens", COUNTER, "Draft tokens the target model accepted.", _M)
TOOL_CALL_PARSE_FAILURES = Metric(
    "kvscale:tool_call_parse_failures", COUNTER,
    "Answers under tool_choice auto whose tool-call markup did not parse (sent as text).", _M)
# Bounded labels: the adapters registered at once are bounded (server/worker/lora_manager.py), and
# an unloaded adapter's series is removed.
LORA_REQUESTS = Metric(
    "kvscale:lora_requests", COUNTER,
    "Requests by the LoRA adapter their `model` named (\"\": the base model).", ("model_name", "lora_name"))
UNKNOWN_REQUEST_FIELDS = Metric(
    "kvscale:unknown_request_fields", COUNTER,
    "Requests carrying a field neither OpenAI's API nor vLLM's extras define (logged once per name).",
    ("model_name", "endpoint"))
# The vLLM-format KV event publisher (--kv-events-config, server/engine/kv_events_vllm.py): its
# queue never blocks the engine, so a slow send drops whole batches; zeros without the flag.
KV_EVENTS_BATCHES_DROPPED = Metric(
    "kvscale:kv_events_batches_dropped", COUNTER,
    "vLLM-format KV event batches (--kv-events-config) dropped on a full queue; subscribers see "
    "the gap in sequence numbers.", _M)
KV_EVENTS_DROPPED = Metric(
    "kvscale:kv_events_dropped", COUNTER,
    "KV events in the vLLM-format batches dropped on a full queue (--kv-events-config).", _M)
# The Redis publisher of the routers' KV index (--redis, server/engine/kv_publisher.py): its queue
# never blocks the engine, so a slow Redis drops events and a full snapshot follows; 0 without it.
KV_INDEX_EVENTS_DROPPED = Metric(
    "kvscale:kv_index_events_dropped", COUNTER,
    "KV events (and blocks of snapshots) for the routers' Redis index (--redis) dropped on a full "
    "queue; each drop is followed by a full resync.", _M)

SERVER_METRICS = (
    NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE, PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS, NUM_PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, TTFT,
    ITL, E2E_LATENCY, QUEUE_TIME, CACHE_CONFIG_INFO, LORA_REQUESTS_INFO, KV_BLOCKS_TOTAL, KV_BLOCKS_ACTIVE,
    KV_BLOCKS_CACHED, KV_BLOCKS_EVICTED, MAX_NUM_SEQS, PREFILL_TOKENS_WAITING, PREFILL_TOKENS_PER_S,
    HTTP_REQUESTS,
    STRUCTURED_REQUESTS, STRUCTURED_COMPILE_SECONDS, STRUCTURED_COMPILE_CACHE_HITS, STRUCTURED_REFUSALS,
    STRUCTURED_MASK_SECONDS, STRUCTURED_MASK_STEPS, STRUCTURED_FORCED_TOKENS, SPEC_DECODE_NUM_DRAFTS, SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS, TOOL_CALL_PARSE_FAILURES, UNKNOWN_REQUEST_FIELDS, LORA_REQUESTS,
    KV_OFFLOAD_BYTES, KV_OFFLOAD_TIME, EXTERNAL_PREFIX_CACHE_QUERIES, EXTERNAL_PREFIX_CACHE_HITS,
    CPU_CACHE_USAGE, KV_HOST_BLOCKS_TOTAL, KV_HOST_BLOCKS_CACHED, KV_BLOCKS_DEMOTED,
    KV_BLOCKS_PROMOTED, KV_PREEMPTIONS_SWAPPED, KV_RESTORE_SECONDS,
    KV_EVENTS_BATCHES_DROPPED, KV_EVENTS_DROPPED, KV_INDEX_EVENTS_DROPPED,
)

# --- kvscale router ---------------------------------------------------------------------------
ROUTER_REQUESTS = Metric(
    "kvscale_router_requests", COUNTER, "Requests proxied, by replica, policy and HTTP status.",
    ("replica", "policy", "status"))
ROUTER_DECISION_SECONDS = Metric(
    "kvscale_router_routing_decision_seconds", HISTOGRAM,
    "Time from a request's last byte to sending it upstream (parse, tokenize, hash, score).")
ROUTER_PREDICTED_HIT_TOKENS = Metric(
    "kvscale_router_predicted_prefix_hit_tokens", COUNTER,
    "Prompt tokens the index predicted cached at the chosen replica.")
ROUTER_PREDICTED_HIT_TOKENS_PER_REQUEST = Metric(
    "kvscale_router_predicted_prefix_hit_tokens_per_request", HISTOGRAM,
    "Predicted cached prompt tokens per decision.")
ROUTER_PROMPT_TOKENS = Metric("kvscale_router_prompt_tokens", COUNTER, "Prompt tokens routed.")
ROUTER_SPILLS = Metric(
    "kvscale_router_spills", COUNTER,
    "Decisions that passed over the replica with the longest cached prefix because it was over "
    "the load bound.")
ROUTER_RETRIES = Metric(
    "kvscale_router_retries", COUNTER, "Retries on another replica, by reason.", ("reason",))
ROUTER_FALLBACKS = Metric(
    "kvscale_router_fallbacks", COUNTER,
    "Decisions made without full information, by reason.", ("reason",))
ROUTER_TOKENIZER_LOADED = Metric(
    "kvscale_router_tokenizer_loaded", GAUGE,
    "1 when the router tokenizes this model's prompts as its servers do; 0 when its tokenizer "
    "could not be loaded, so its requests are routed by load alone.", _M)
ROUTER_REDIS_ERRORS = Metric(
    "kvscale_router_redis_errors", COUNTER, "Failed or timed-out Redis calls.")
ROUTER_REDIS_UP = Metric("kvscale_router_redis_up", GAUGE, "1 while Redis answers.")
ROUTER_REPLICAS_HEALTHY = Metric("kvscale_router_replicas_healthy", GAUGE, "Routable replicas.")
ROUTER_IN_FLIGHT = Metric(
    "kvscale_router_in_flight_requests", GAUGE, "Open requests by replica.", ("replica",))
ROUTER_INDEX_BLOCKS = Metric(
    "kvscale_router_index_blocks", GAUGE, "Confirmed block hashes in the index, by replica.",
    ("replica",))

# Scale from zero: requests the router holds while no replica is ready (router/activation.py).
ROUTER_HELD_REQUESTS = Metric(
    "kvscale_router_held_requests", GAUGE,
    "Requests held for a replica to become ready (the service scaling up from zero).")
ROUTER_HOLDS = Metric(
    "kvscale_router_holds", COUNTER,
    "Held requests by how their hold ended: released to a replica, timeout (503), full (503, the "
    "hold queue was full) or disconnected (the client left).", ("outcome",))
ROUTER_HOLD_SECONDS = Metric(
    "kvscale_router_hold_seconds", HISTOGRAM, "Time a request was held before its hold ended.")
ROUTER_COLD_START_SECONDS = Metric(
    "kvscale_router_cold_start_seconds", HISTOGRAM,
    "From the first request held at zero ready replicas to a replica ready to take it.")
ROUTER_ACTIVATIONS = Metric(
    "kvscale_router_activations", COUNTER,
    "Requests to raise the service's replicas from zero, by result (scaled, already: the scale "
    "was above zero, error).", ("result",))

# --max-queue-wait: generation requests waiting in the router for room on their replicas
# (router/fair_queue.py); zero in a router without it.
ROUTER_QUEUED_REQUESTS = Metric(
    "kvscale_router_queued_requests", GAUGE,
    "Generation requests waiting in the router for room on their replicas (--max-queue-wait).")
ROUTER_QUEUE_WAITS = Metric(
    "kvscale_router_queue_waits", COUNTER,
    "Requests that waited in the router's queue, by how the wait ended: released to a replica, "
    "timeout (503 after --max-queue-wait), full (503, the queue was full) or disconnected (the "
    "client left).", ("outcome",))
ROUTER_QUEUE_WAIT_SECONDS = Metric(
    "kvscale_router_queue_wait_seconds", HISTOGRAM,
    "Time a request waited in the router's queue before its wait ended.")

ROUTER_METRICS = (
    ROUTER_REQUESTS, ROUTER_DECISION_SECONDS, ROUTER_PREDICTED_HIT_TOKENS,
    ROUTER_PREDICTED_HIT_TOKENS_PER_REQUEST, ROUTER_PROMPT_TOKENS, ROUTER_SPILLS, ROUTER_RETRIES,
    ROUTER_FALLBACKS, ROUTER_TOKENIZER_LOADED, ROUTER_REDIS_ERRORS, ROUTER_REDIS_UP, ROUTER_REPLICAS_HEALTHY,
    ROUTER_IN_FLIGHT, ROUTER_INDEX_BLOCKS,
    ROUTER_HELD_REQUESTS, ROUTER_HOLDS, ROUTER_HOLD_SECONDS, ROUTER_COLD_START_SECONDS,
    ROUTER_ACTIVATIONS, ROUTER_QUEUED_REQUESTS, ROUTER_QUEUE_WAITS, ROUTER_QUEUE_WAIT_SECONDS,
)
# Tenants (docs/router.md, "Tenants"): labelled by the names of --tenants FILE only, so they
# have series only in a router given one; kept apart from ROUTER_METRICS, which every router
# exports.
ROUTER_TENANT_REQUESTS = Metric(
    "kvscale_router_tenant_requests", COUNTER,
    "Generation requests by tenant (authenticated by the tenant's key), let in or not.",
    ("tenant",))
ROUTER_TENANT_RATE_LIMITED = Metric(
    "kvscale_router_tenant_rate_limited", COUNTER,
    "Requests answered 429 by tenant and the limit they reached (requests or tokens per minute).",
    ("tenant", "limit"))
ROUTER_TENANT_LIMITS_UNCHECKED = Metric(
    "kvscale_router_tenant_limits_unchecked", COUNTER,
    "Requests let in without their tenant's limits checked: Redis failed or did not answer in "
    "time (the limits fail open).")
ROUTER_TENANT_TOKENS = Metric(
    "kvscale_router_tenant_tokens", COUNTER,
    "Prompt plus completion tokens of each tenant's answers, as their usage reports them (an "
    "answer without usage counts none).", ("tenant",))
ROUTER_TENANT_QUEUE_WAIT_SECONDS = Metric(
    "kvscale_router_tenant_queue_wait_seconds", COUNTER,
    "Seconds each tenant's requests waited in the router's queue (--max-queue-wait).", ("tenant",))
ROUTER_FAIR_SHARE_SHARED = Metric(
    "kvscale_router_fair_share_shared", GAUGE,
    "1 while the tenants' fair-share counters of the router's queue are the fleet's, kept in "
    "Redis; 0 while it orders tenants by its own counters (Redis failed, or no --tenants or "
    "--max-queue-wait).")
ROUTER_TENANT_METRICS = (
    ROUTER_TENANT_REQUESTS, ROUTER_TENANT_RATE_LIMITED, ROUTER_TENANT_LIMITS_UNCHECKED,
    ROUTER_TENANT_TOKENS, ROUTER_TENANT_QUEUE_WAIT_SECONDS, ROUTER_FAIR_SHARE_SHARED)
# Adapters loaded at run time through the router, loaded again onto replicas that lack them
# (router/lora_replay.py): only in a router given --allow-runtime-lora-updating.
ROUTER_LORA_REPLAYS = Metric(
    "kvscale_router_lora_replays", COUNTER,
    "Loads of an adapter loaded at run time through the router onto a replica that lacked it (one "
    "that joined or came back), by result (loaded, failed: retried at the next health check).",
    ("result",))
ROUTER_LORA_METRICS = (ROUTER_LORA_REPLAYS,)
ROUTER_LORA_REPLAY_RESULTS = ("loaded", "failed")
ROUTER_HOLD_OUTCOMES = ("released", "timeout", "full", "disconnected")
ROUTER_QUEUE_OUTCOMES = ROUTER_HOLD_OUTCOMES
ROUTER_ACTIVATION_RESULTS = ("scaled", "already", "error")
# Label values created at zero on start, so rate() is defined before the first event of each.
ROUTER_RETRY_REASONS = ("status_5xx", "timeout", "connection")
ROUTER_FALLBACK_REASONS = ("no_tokenizer", "untokenizable", "redis_down")

# --- kvscale operator (per InferenceService) -------------------------------------------------
_IS = ("namespace", "inferenceservice")
OPERATOR_LOAD = Metric(
    "kvscale_operator_autoscaler_load", GAUGE,
    "The autoscaler's signal: demand in replicas' worth, the larger of occupancy / targetKVUsage "
    "+ waiting / targetQueueLength and queued prefill seconds / targetPrefillSeconds.", _IS)
OPERATOR_KV_USAGE = Metric(
    "kvscale_operator_autoscaler_kv_usage", GAUGE,
    "Mean share of KV blocks held by live requests over the pods that reported.", _IS)
OPERATOR_OCCUPANCY = Metric(
    "kvscale_operator_autoscaler_occupancy", GAUGE,
    "Mean occupancy over the pods that reported: per pod the fuller of KV blocks held by live "
    "requests and batch slots in use; the signal compared with targetKVUsage.", _IS)
OPERATOR_WAITING = Metric(
    "kvscale_operator_autoscaler_waiting_requests", GAUGE,
    "Waiting requests over all pods (missing pods extrapolated).", _IS)
# The load's second measure (operator/scaling.py): prompt work queued, timed at each pod's rate.
OPERATOR_PREFILL_SECONDS = Metric(
    "kvscale_operator_autoscaler_prefill_seconds", GAUGE,
    "Seconds of queued prefill over all pods (per pod kvscale:prefill_tokens_waiting / its "
    "kvscale:prefill_tokens_per_s; missing pods extrapolated): the signal compared with "
    "targetPrefillSeconds.", _IS)
OPERATOR_TARGET_KV_USAGE = Metric(
    "kvscale_operator_autoscaler_target_kv_usage", GAUGE, "spec.autoscaling.targetKVUsage.", _IS)
OPERATOR_TARGET_QUEUE = Metric(
    "kvscale_operator_autoscaler_target_queue_length", GAUGE,
    "spec.autoscaling.targetQueueLength.", _IS)
OPERATOR_TARGET_PREFILL_SECONDS = Metric(
    "kvscale_operator_autoscaler_target_prefill_seconds", GAUGE,
    "spec.autoscaling.targetPrefillSeconds.", _IS)
OPERATOR_PANIC = Metric(
    "kvscale_operator_autoscaler_panic", GAUGE, "1 while the autoscaler is in panic mode.", _IS)
OPERATOR_DESIRED = Metric(
    "kvscale_operator_desired_replicas", GAUGE, "Replicas the autoscaler (or the spec) wants.", _IS)
OPERATOR_CURRENT = Metric(
    "kvscale_operator_current_replicas", GAUGE, "Pods that exist and are not terminating.", _IS)
OPERATOR_READY = Metric("kvscale_operator_ready_replicas", GAUGE, "Ready pods.", _IS)
OPERATOR_MIN = Metric(
    "kvscale_operator_min_replicas", GAUGE,
    "spec.autoscaling.minReplicas, while autoscaling is enabled (no series otherwise).", _IS)
OPERATOR_MAX = Metric(
    "kvscale_operator_max_replicas", GAUGE,
    "spec.autoscaling.maxReplicas, while autoscaling is enabled (no series otherwise).", _IS)
OPERATOR_SCALE_DECISIONS = Metric(
    "kvscale_operator_scale_decisions", COUNTER,
    "Changes of spec.replicas made by the autoscaler, by direction (up/down) and reason.",
    (*_IS, "direction", "reason"))
OPERATOR_RECONCILE_ERRORS = Metric(
    "kvscale_operator_reconcile_errors", COUNTER,
    "Reconciliations and autoscaler runs that failed, by handler.", (*_IS, "handler"))

OPERATOR_HELD_REQUESTS = Metric(
    "kvscale_operator_held_requests", GAUGE,
    "Requests the routers hold for a replica (the service at zero), as the autoscaler last read "
    "them.", _IS)
OPERATOR_COLD_START_SECONDS = Metric(
    "kvscale_operator_cold_start_seconds", GAUGE,
    "The last scale from zero: from the activation to the first ready replica.", _IS)

OPERATOR_METRICS = (
    OPERATOR_LOAD, OPERATOR_KV_USAGE, OPERATOR_OCCUPANCY, OPERATOR_WAITING, OPERATOR_PREFILL_SECONDS,
    OPERATOR_TARGET_KV_USAGE, OPERATOR_TARGET_QUEUE, OPERATOR_TARGET_PREFILL_SECONDS, OPERATOR_PANIC, OPERATOR_DESIRED, OPERATOR_CURRENT, OPERATOR_READY,
    OPERATOR_MIN, OPERATOR_MAX, OPERATOR_SCALE_DECISIONS, OPERATOR_RECONCILE_ERRORS,
    OPERATOR_HELD_REQUESTS, OPERATOR_COLD_START_SECONDS,
)

ALL_METRICS = SERVER_METRICS + ROUTER_METRICS + ROUTER_TENANT_METRICS + ROUTER_LORA_METRICS + OPERATOR_METRICS


def exposed_sample_names(metric: Metric) -> tuple[str, ...]:
    """The sample names a scrape of `metric` shows (histograms: buckets, sum and count)."""
    if metric.type == HISTOGRAM:
        return (metric.bucket, metric.sum, metric.count)
    return (metric.series,)
