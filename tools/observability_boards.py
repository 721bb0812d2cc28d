"""kvscale's three Grafana dashboards as data: autoscaling (why the operator scaled), serving
(the engine replicas) and router (where traffic goes), each a Board of Panels
(observability_panels.py)."""

from __future__ import annotations

from observability_panels import (
    NOT_2XX,
    RATE,
    SEL_ROUTER,
    SEL_SERVER,
    SEL_SERVICE,
    Board,
    Panel,
    q,
    quantile,
    rate,
    sel,
)

from kvscale import metric_names as m

# --------------------------------------------------------------------------------- Autoscaling
SCALE_EVENTS = (f"sum by (namespace, inferenceservice, direction, reason) "
                f"(increase({sel(m.OPERATOR_SCALE_DECISIONS.series, SEL_SERVICE)}[{RATE}])) > 0")

# The rule of operator/scaling.py, as its docstring and docs/operator.md write it.
LOAD_RULE = ("load = max(Σ occupancy / targetKVUsage + Σ waiting / targetQueueLength, "
             "Σ prefill seconds / targetPrefillSeconds), Σ over pods: per pod, occupancy is the "
             "fuller of KV blocks held by live requests and batch slots in use, prefill seconds "
             "its kvscale:prefill_tokens_waiting / kvscale:prefill_tokens_per_s. The two "
             "measures are not added: either alone needs that many replicas. Desired replicas "
             "follow ceil(load) through the stabilization windows, panic mode and the step "
             "limit, within min/max.")

AUTOSCALING = Board(
    uid="kvscale-autoscaling",
    title="kvscale / Autoscaling",
    description="Why the operator added or removed replicas: its signal, target and decisions.",
    pod_source=m.NUM_REQUESTS_RUNNING.series,
    annotations=(("Scale decisions", SCALE_EVENTS),),
    panels=(
        Panel("Occupancy signal vs target", (
            q(sel(m.OPERATOR_OCCUPANCY.series, SEL_SERVICE), "{{inferenceservice}} occupancy"),
            q(sel(m.OPERATOR_KV_USAGE.series, SEL_SERVICE), "{{inferenceservice}} KV usage (live)"),
            q(sel(m.OPERATOR_TARGET_KV_USAGE.series, SEL_SERVICE), "{{inferenceservice}} target"),
        ), unit="percentunit",
            description="Mean occupancy (per pod the fuller of KV blocks held by live requests and "
                        "batch slots in use) and mean KV usage, against targetKVUsage."),
        Panel("Load (replicas' worth) vs desired replicas", (
            q(sel(m.OPERATOR_LOAD.series, SEL_SERVICE), "{{inferenceservice}} load"),
            q(sel(m.OPERATOR_DESIRED.series, SEL_SERVICE), "{{inferenceservice}} desired"),
        ), description=LOAD_RULE),
        Panel("Queued prefill seconds vs target", (
            q(sel(m.OPERATOR_PREFILL_SECONDS.series, SEL_SERVICE), "{{inferenceservice}} prefill queued"),
            q(sel(m.OPERATOR_TARGET_PREFILL_SECONDS.series, SEL_SERVICE),
              "{{inferenceservice}} target"),
        ), unit="s",
            description="The load's second measure: seconds of prompt work queued over all pods "
                        "(per pod kvscale:prefill_tokens_waiting / its measured "
                        "kvscale:prefill_tokens_per_s), against targetPrefillSeconds; each "
                        "targetPrefillSeconds of it asks for one replica."),
        Panel("Waiting requests: autoscaler view vs target", (
            q(sel(m.OPERATOR_WAITING.series, SEL_SERVICE), "{{inferenceservice}} waiting"),
            q(sel(m.OPERATOR_TARGET_QUEUE.series, SEL_SERVICE), "{{inferenceservice}} target"),
        )),
        Panel("Replicas: desired / current / ready", (
            q(sel(m.OPERATOR_DESIRED.series, SEL_SERVICE), "{{inferenceservice}} desired"),
            q(sel(m.OPERATOR_CURRENT.series, SEL_SERVICE), "{{inferenceservice}} current"),
            q(sel(m.OPERATOR_READY.series, SEL_SERVICE), "{{inferenceservice}} ready"),
            q(sel(m.OPERATOR_MAX.series, SEL_SERVICE), "{{inferenceservice}} max"),
        )),
        Panel("Scale decisions", (
            q(f"sum by (direction, reason) (increase("
              f"{sel(m.OPERATOR_SCALE_DECISIONS.series, SEL_SERVICE)}[{RATE}]))",
              "{{direction}} ({{reason}})"),
        ), bars=True),
        Panel("Panic mode", (
            q(sel(m.OPERATOR_PANIC.series, SEL_SERVICE), "{{inferenceservice}} panic"),
        ), description="1 while a burst keeps the autoscaler from scaling down."),
        Panel("KV blocks per pod: active / cached / total", (
            q(sel(m.KV_BLOCKS_ACTIVE.series, SEL_SERVER), "{{pod}} active"),
            q(sel(m.KV_BLOCKS_CACHED.series, SEL_SERVER), "{{pod}} cached"),
            q(sel(m.KV_BLOCKS_TOTAL.series, SEL_SERVER), "{{pod}} total"),
        )),
        Panel("Running and waiting requests per pod", (
            q(sel(m.NUM_REQUESTS_RUNNING.series, SEL_SERVER), "{{pod}} running"),
            q(sel(m.NUM_REQUESTS_WAITING.series, SEL_SERVER), "{{pod}} waiting"),
        )),
        Panel("Queue's effect on TTFT (p90)", (
            q(quantile(0.9, m.TTFT, SEL_SERVER), "TTFT p90"),
            q(quantile(0.9, m.QUEUE_TIME, SEL_SERVER), "queue time p90"),
        ), unit="s"),
        Panel("Scale from zero: requests held", (
            q(sel(m.OPERATOR_HELD_REQUESTS.series, SEL_SERVICE), "{{inferenceservice}} held (operator)"),
            q(f"sum by (inferenceservice) ({sel(m.ROUTER_HELD_REQUESTS.series, SEL_SERVICE)})",
              "{{inferenceservice}} held (routers)"),
            q(f"sum by (outcome) (increase({sel(m.ROUTER_HOLDS.series, SEL_SERVICE)}[{RATE}]))",
              "holds ended: {{outcome}}"),
        ), description="minReplicas 0: requests the routers hold while no replica is ready, and "
                       "how their holds ended (timeout and full are 503s)."),
        Panel("Scale from zero: cold start", (
            q(sel(m.OPERATOR_COLD_START_SECONDS.series, SEL_SERVICE), "{{inferenceservice}} last cold start"),
            q(quantile(0.9, m.ROUTER_HOLD_SECONDS, SEL_SERVICE), "hold time p90"),
        ), unit="s", description="From the first held request to a ready replica (the activation), "
                                 "and how long requests were held."),
    ),
)

# ------------------------------------------------------------------------------------ Serving
BASE_MODEL = "(base model)"  # the lora_name of requests naming no adapter

SERVING = Board(
    uid="kvscale-serving",
    title="kvscale / Serving",
    description="Throughput, latency, prefix caching and errors of the kvscale serve replicas.",
    pod_source=m.NUM_REQUESTS_RUNNING.series,
    panels=(
        Panel("Tokens/s in and out", (
            q(f"sum({rate(m.PROMPT_TOKENS.series, SEL_SERVER)})", "prompt tokens/s"),
            q(f"sum({rate(m.GENERATION_TOKENS.series, SEL_SERVER)})", "generated tokens/s"),
        )),
        Panel("Time to first token", tuple(
            q(quantile(p, m.TTFT, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("Inter-token latency", tuple(
            q(quantile(p, m.ITL, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("End-to-end latency", tuple(
            q(quantile(p, m.E2E_LATENCY, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("Prefix-cache hit rate", (
            q(f"sum({rate(m.PREFIX_CACHE_HITS.series, SEL_SERVER)}) / "
              f"sum({rate(m.PREFIX_CACHE_QUERIES.series, SEL_SERVER)})", "hit rate"),
        ), unit="percentunit", description="Prompt tokens found cached / looked up, over the window."),
        Panel("KV cache usage per pod", (
            q(sel(m.KV_CACHE_USAGE.series, SEL_SERVER), "{{pod}}"),
        ), unit="percentunit"),
        Panel("Preemptions and KV evictions", (
            q(f"sum by (pod) ({rate(m.NUM_PREEMPTIONS.series, SEL_SERVER)})", "{{pod}} preemptions/s"),
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_EVICTED.series, SEL_SERVER)})",
              "{{pod}} evicted blocks/s"),
        )),
        Panel("Host KV tier: blocks", (
            q(f"sum by (pod) ({sel(m.KV_HOST_BLOCKS_CACHED.series, SEL_SERVER)})", "{{pod}} cached"),
            q(f"sum by (pod) ({sel(m.KV_HOST_BLOCKS_TOTAL.series, SEL_SERVER)})", "{{pod}} total"),
        ), description="Blocks of the second KV tier (--kv-offloading-size) holding a prefix block."),
        Panel("Host KV tier: demotions, promotions, swaps", (
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_DEMOTED.series, SEL_SERVER)})", "{{pod}} demoted blocks/s"),
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_PROMOTED.series, SEL_SERVER)})", "{{pod}} promoted blocks/s"),
            q(f"sum by (pod) ({rate(m.KV_PREEMPTIONS_SWAPPED.series, SEL_SERVER)})", "{{pod}} swapped preemptions/s"),
        )),
        Panel("Host KV tier: hit rate and copy bandwidth", (
            q(f"sum({rate(m.EXTERNAL_PREFIX_CACHE_HITS.series, SEL_SERVER)}) / "
              f"sum({rate(m.EXTERNAL_PREFIX_CACHE_QUERIES.series, SEL_SERVER)})", "tier-2 hit rate"),
            q(f"sum by (transfer_type) ({rate(m.KV_OFFLOAD_BYTES.series, SEL_SERVER)}) / "
              f"sum by (transfer_type) ({rate(m.KV_OFFLOAD_TIME.series, SEL_SERVER)})",
              "{{transfer_type}} bytes per copy second"),
        ), description="Tokens found in the host tier / looked up there (a fraction); copy bytes per "
                       "second spent copying (bytes/s)."),
        Panel("Host KV tier: restore latency", tuple(
            q(quantile(p, m.KV_RESTORE_SECONDS, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s", description="One step's batch of promotions, host tier to KV cache."),
        Panel("Finish reasons", (
            q(f"sum by (finished_reason) ({rate(m.REQUEST_SUCCESS.series, SEL_SERVER)})",
              "{{finished_reason}}"),
        ), unit="reqps", bars=True),
        Panel("Errors by status", (
            q(f"sum by (status, route) "
              f"({rate(m.HTTP_REQUESTS.series, SEL_SERVER, NOT_2XX)})",
              "{{status}} {{route}}"),
        ), unit="reqps", width=24),
        Panel("Structured outputs: constrained requests and refusals", (
            q(f"sum by (kind) ({rate(m.STRUCTURED_REQUESTS.series, SEL_SERVER)})", "{{kind}}"),
            q(f"sum by (reason) ({rate(m.STRUCTURED_REFUSALS.series, SEL_SERVER)})", "refused: {{reason}}"),
            q(f"sum({rate(m.TOOL_CALL_PARSE_FAILURES.series, SEL_SERVER)})", "tool-call parse failures"),
            q(f"sum({rate(m.UNKNOWN_REQUEST_FIELDS.series, SEL_SERVER)})", "unknown request fields"),
        ), unit="reqps"),
        Panel("Grammar compile time and cache hits", (
            q(quantile(0.5, m.STRUCTURED_COMPILE_SECONDS, SEL_SERVER), "compile p50"),
            q(quantile(0.99, m.STRUCTURED_COMPILE_SECONDS, SEL_SERVER), "compile p99"),
            q(f"sum({rate(m.STRUCTURED_COMPILE_CACHE_HITS.series, SEL_SERVER)}) / "
              f"(sum({rate(m.STRUCTURED_COMPILE_CACHE_HITS.series, SEL_SERVER)}) + "
              f"sum({rate(m.STRUCTURED_COMPILE_SECONDS.count, SEL_SERVER)}))", "cache hit ratio"),
        ), unit="s"),
        Panel("Grammar mask time per step", (
            q(f"sum by (pod) ({rate(m.STRUCTURED_MASK_SECONDS.series, SEL_SERVER)}) / "
              f"sum by (pod) ({rate(m.STRUCTURED_MASK_STEPS.series, SEL_SERVER)})", "{{pod}}"),
        ), unit="s"),
        Panel("Grammar fast-forward: forced share of output tokens", (
            q(f"sum by (pod) ({rate(m.STRUCTURED_FORCED_TOKENS.series, SEL_SERVER)}) / "
              f"sum by (pod) ({rate(m.GENERATION_TOKENS.series, SEL_SERVER)})", "{{pod}}"),
        ), unit="percentunit", description="Tokens appended because the grammar allowed nothing else "
                                           "(keys, punctuation), each saving a decode step, over all "
                                           "output tokens."),
        Panel("Requests per LoRA adapter", (
            # The base model's series has an empty lora_name: named, so its legend is not blank.
            q(f'label_replace(sum by (lora_name) ({rate(m.LORA_REQUESTS.series, SEL_SERVER)}), '
              f'"lora_name", "{BASE_MODEL}", "lora_name", "")', "{{lora_name}}"),
        ), unit="reqps", description="Requests by the LoRA adapter their `model` named "
                                     "(--lora-modules, spec.adapters), the base model's as "
                                     f"{BASE_MODEL}; an unloaded adapter's series ends."),
    ),
)

# ------------------------------------------------------------------------------------- Router
ROUTER = Board(
    uid="kvscale-router",
    title="kvscale / Router",
    description="Where the prefix-aware router sends traffic, and how well it predicts caches.",
    pod_source=m.ROUTER_REPLICAS_HEALTHY.series,
    # The routers' own series with a model_name: the model each router tokenizes for.
    service_source=m.ROUTER_TOKENIZER_LOADED.series,
    panels=(
        Panel("Traffic per replica", (
            q(f"sum by (replica) ({rate(m.ROUTER_REQUESTS.series, SEL_ROUTER)})", "{{replica}}"),
        ), unit="reqps"),
        Panel("Requests by status", (
            q(f"sum by (status) ({rate(m.ROUTER_REQUESTS.series, SEL_ROUTER)})", "{{status}}"),
        ), unit="reqps"),
        Panel("Prefix hit rate: router's prediction vs engines' observation", (
            q(f"sum({rate(m.ROUTER_PREDICTED_HIT_TOKENS.series, SEL_ROUTER)}) / "
              f"sum({rate(m.ROUTER_PROMPT_TOKENS.series, SEL_ROUTER)})", "predicted (router)"),
            q(f"sum({rate(m.PREFIX_CACHE_HITS.series, SEL_SERVICE)}) / "
              f"sum({rate(m.PREFIX_CACHE_QUERIES.series, SEL_SERVICE)})", "observed (engines)"),
        ), unit="percentunit"),
        Panel("In-flight requests per replica", (
            q(f"sum by (replica) ({sel(m.ROUTER_IN_FLIGHT.series, SEL_ROUTER)})", "{{replica}}"),
        )),
        Panel("Spills, retries and fallbacks", (
            q(f"sum({rate(m.ROUTER_SPILLS.series, SEL_ROUTER)})", "spills/s"),
            q(f"sum by (reason) ({rate(m.ROUTER_RETRIES.series, SEL_ROUTER)})", "retry {{reason}}"),
            q(f"sum by (reason) ({rate(m.ROUTER_FALLBACKS.series, SEL_ROUTER)})",
              "fallback {{reason}}"),
        )),
        Panel("Redis health", (
            q(f"min({sel(m.ROUTER_REDIS_UP.series, SEL_ROUTER)})", "Redis up"),
            q(f"sum({rate(m.ROUTER_REDIS_ERRORS.series, SEL_ROUTER)})", "Redis errors/s"),
            q(f"min({sel(m.ROUTER_REPLICAS_HEALTHY.series, SEL_ROUTER)})", "healthy replicas"),
        )),
        Panel("Prefix index size per replica", (
            q(f"max by (replica) ({sel(m.ROUTER_INDEX_BLOCKS.series, SEL_ROUTER)})", "{{replica}}"),
        )),
        Panel("Routing decision latency", tuple(
            q(quantile(p, m.ROUTER_DECISION_SECONDS, SEL_ROUTER), f"p{int(p * 100)}")
            for p in (0.5, 0.99)
        ), unit="s"),
        # Tenants (docs/router.md, "Tenants"): series only in routers given --tenants.
        Panel("Requests and 429s per tenant", (
            q(f"sum by (tenant) ({rate(m.ROUTER_TENANT_REQUESTS.series, SEL_ROUTER)})",
              "{{tenant}}"),
            q(f"sum by (tenant, limit) ({rate(m.ROUTER_TENANT_RATE_LIMITED.series, SEL_ROUTER)})",
              "{{tenant}} 429 ({{limit}})"),
        ), unit="reqps", description="Generation requests by tenant, let in or not, and those "
                                     "answered 429 by the limit they reached (--tenants)."),
        Panel("Tokens per tenant", (
            q(f"sum by (tenant) ({rate(m.ROUTER_TENANT_TOKENS.series, SEL_ROUTER)})",
              "{{tenant}}"),
        ), description="Prompt plus completion tokens per second of each tenant's answers, as "
                       "their usage reports them."),
        Panel("Queue wait per tenant", (
            q(f"sum by (tenant) ({rate(m.ROUTER_TENANT_QUEUE_WAIT_SECONDS.series, SEL_ROUTER)}) / "
              f"sum by (tenant) ({rate(m.ROUTER_TENANT_REQUESTS.series, SEL_ROUTER)})",
              "{{tenant}} mean wait"),
            q(f"min({sel(m.ROUTER_FAIR_SHARE_SHARED.series, SEL_ROUTER)})",
              "fair-share counters shared (1) or each router's own (0)"),
        ), unit="s", description="Seconds a tenant's requests waited in the routers' queue "
                                 "(--max-queue-wait) per request, and whether the routers order "
                                 "tenants by the fleet's counters in Redis (docs/router.md, "
                                 "\"Fair share across routers\")."),
    ),
)

BOARDS = {"autoscaling": AUTOSCALING, "serving": SERVING, "router": ROUTER}
