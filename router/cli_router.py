"""`kvscale router`: the prefix-affinity router in front of `kvscale serve` replicas."""

from __future__ import annotations

import argparse
import logging
import os

from kvscale import request_limits
from kvscale.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
from kvscale.router.activation import DEFAULT_HOLD_QUEUE
from kvscale.router.admission import DEFAULT_BODY_BUDGET_BYTES, DEFAULT_MAX_OPEN_REQUESTS
from kvscale.router.chat_tokens import DEFAULT_MAX_TOKENS
from kvscale.router.config import RouterConfig
from kvscale.router.engine_priority import SCHEDULING_POLICIES
from kvscale.router.policy import DEFAULT_POLICY, POLICIES, TTFT_EPSILON
from kvscale.router.tenants import TenantFile, TenantFileError
from kvscale.tokenization import TOOL_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("replicas (one of)")
    where.add_argument("--replicas", default=None, help="comma-separated replica base URLs (http://host:port)")
    where.add_argument("--k8s-service", default=None, help="headless Service whose EndpointSlices list the replicas")
    where.add_argument(
        "--k8s-namespace-wide",
        action="store_true",
        help="the servers of every InferenceService in --namespace, routed by the request's model",
    )
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    parser.add_argument("--k8s-port-name", default=None, help="EndpointSlice port name (default: the first port)")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    parser.add_argument(
        "--redis",
        default=os.environ.get("KVSCALE_REDIS_URL"),
        help="redis://host:port for the replicas' KV events and heartbeats (default: $KVSCALE_REDIS_URL)",
    )
    parser.add_argument("--redis-timeout-ms", type=float, default=50.0)
    parser.add_argument("--api-key", default=os.environ.get("KVSCALE_API_KEY"), help="key clients must send (Bearer)")
    parser.add_argument(
        "--tenants", default=None, metavar="FILE",
        help="YAML list of tenants (name, api_key or api_key_sha256, requests_per_minute, "
             "tokens_per_minute, weight, priority): a key per tenant instead of --api-key, limits "
             "counted in --redis; re-read when the file changes")
    parser.add_argument(
        "--replica-api-key",
        default=os.environ.get("KVSCALE_REPLICA_API_KEY"),
        help="key the router sends to the replicas (default: none)",
    )
    parser.add_argument("--host", default=None,
                        help="address to bind, and only it (default: every address, IPv4 and IPv6)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--ext-proc-port", type=int, default=None,
        help="also serve Envoy's ext_proc gRPC service on this port: the router as a Gateway API "
             "Inference Extension endpoint picker (docs/gateway.md)")
    request_limits.add_arguments(parser)
    parser.add_argument(
        "--max-open-requests", type=int, default=DEFAULT_MAX_OPEN_REQUESTS,
        help="requests open at once (reading, routed or streaming); one more gets 503 with Retry-After "
             f"(default {DEFAULT_MAX_OPEN_REQUESTS})")
    parser.add_argument(
        "--max-body-bytes-in-flight", type=int, default=DEFAULT_BODY_BUDGET_BYTES,
        help="request-body bytes held at once over every open request; a request whose body would pass "
             f"it gets 503 with Retry-After (default {DEFAULT_BODY_BUDGET_BYTES // 2**20} MiB, at least "
             "--max-request-body-bytes)")
    parser.add_argument(
        "--block-size", type=int, default=16, help="replicas' KV block size (heartbeats override it per model)"
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="model directory whose tokenizer to load (repeatable; default: the bundled model)",
    )
    parser.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="the names the servers serve the one --model (or the bundled model) under, as their "
             "own --served-model-name; default: the model folder's name",
    )
    parser.add_argument(
        "--lora-adapter-names", nargs="+", default=None, metavar="NAME",
        help="the servers' LoRA adapters (their --lora-modules names): with --hold-timeout, a request "
             "naming one while no replica is up is held and wakes them, as one for --served-model-name")
    parser.add_argument(
        "--chat-cache-tokens", type=int, default=DEFAULT_MAX_TOKENS,
        help="token ids of chat histories kept so a follow-up turn tokenizes only its new part (0: off)",
    )
    parser.add_argument(
        "--tool-call-parser", choices=TOOL_FORMATS, default="hermes",
        help="the servers' --tool-call-parser: the format their prompts render tools and tool calls "
             "in, so the router hashes an agent's prompt as they do (default: hermes, as theirs)")
    parser.add_argument(
        "--session-header", default="x-session-id",
        help="header that pins a session to a replica (until that replica is overloaded, as a prefix's holder)")
    parser.add_argument(
        "--balance-epsilon", type=float, default=0.25,
        help="predicted-ttft: a prefix's holder keeps a request until its predicted TTFT exceeds (1+eps) x "
             "(the best other's + the prefill the hit saves); prefix-affinity: at most (1+eps) x mean in flight")
    parser.add_argument(
        "--ttft-balance-epsilon", type=float, default=TTFT_EPSILON,
        help="predicted-ttft's safety valve: no replica above (1+eps) x mean in-flight requests (negative: off)",
    )
    parser.add_argument(
        "--ttft-calibration", action=argparse.BooleanOptionalAction, default=False,
        help="predicted-ttft: decide on each replica's estimate corrected by how its measured TTFTs compared "
             "with their predictions (relative to the pool, within 2x). Off by default: the corrected "
             "estimate is then only reported (x-kvscale-predicted-ttft-ms)")
    parser.add_argument("--max-attempts", type=int, default=3, help="replicas tried per request before failing")
    parser.add_argument(
        "--hold-timeout", type=float, default=None, metavar="SECONDS",
        help="while no replica is ready (the service scaled to zero), hold requests up to this long "
             "for one to come up, then answer 503 with Retry-After (default: 503 at once)")
    parser.add_argument(
        "--hold-queue", type=int, default=DEFAULT_HOLD_QUEUE,
        help="requests held at once with --hold-timeout; one more is answered 503 at once")
    parser.add_argument(
        "--scale-from-zero", default=None, metavar="INFERENCESERVICE",
        help="with --hold-timeout: the InferenceService (in --namespace) whose scale the router "
             "raises from 0 to 1 when it holds a request")
    parser.add_argument(
        "--max-queue-wait", type=float, default=None, metavar="SECONDS",
        help="while the replicas that could take a generation request have no room (their heartbeats' "
             "running and waiting sequences fill max_num_seqs, or their KV blocks are held), it waits "
             "in the router up to this long, leaving by the tenants' priority, then weighted fair "
             "share; then 503 with Retry-After (default: off, every request is sent at once). Needs --redis")
    parser.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
        help="the replicas' --scheduling-policy: with priority, a tenant's priority goes to them as its "
             "requests' priority field (a request's own may be less urgent, never more)")
    parser.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="pass POST /v1/load_lora_adapter and /v1/unload_lora_adapter on to every healthy replica "
             "(each needs its own flag); one answer: 200 when all succeeded, else which failed")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between replica health checks")
    parser.add_argument("--seed", type=int, default=None, help="seed for --policy random")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="on SIGTERM, how long proxied requests may take to finish while /health and new requests "
             f"answer 503 (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}: fits a 60 s pod grace period with a short preStop)",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if sum(map(bool, (args.replicas, args.k8s_service, args.k8s_namespace_wide))) != 1:
        raise SystemExit("kvscale router: give one of --replicas URL,..., --k8s-service NAME or --k8s-namespace-wide")
    if args.balance_epsilon < 0:
        raise SystemExit("kvscale router: --balance-epsilon must be non-negative")
    if args.block_size < 1:
        raise SystemExit("kvscale router: --block-size must be at least 1")
    if args.chat_cache_tokens < 0:
        raise SystemExit("kvscale router: --chat-cache-tokens must be non-negative")
    if args.hold_timeout is not None and args.hold_timeout <= 0:
        raise SystemExit("kvscale router: --hold-timeout must be positive")
    if args.hold_queue < 1:
        raise SystemExit("kvscale router: --hold-queue must be at least 1")
    if args.scale_from_zero and args.hold_timeout is None:
        raise SystemExit("kvscale router: --scale-from-zero needs --hold-timeout")
    if args.max_queue_wait is not None and not args.max_queue_wait > 0:
        raise SystemExit("kvscale router: --max-queue-wait must be positive")
    if args.max_queue_wait is not None and not args.redis:
        raise SystemExit("kvscale router: --max-queue-wait needs --redis: the replicas' load comes from "
                         "their heartbeats")
    if args.max_open_requests < 1:
        raise SystemExit("kvscale router: --max-open-requests must be at least 1")
    if args.max_body_bytes_in_flight < args.max_request_body_bytes:
        raise SystemExit("kvscale router: --max-body-bytes-in-flight must be at least --max-request-body-bytes")
    tenants = _tenants(args)
    if args.served_model_name and len(args.model or [None]) != 1:
        raise SystemExit("kvscale router: --served-model-name names one model: give at most one --model with it")
    return RouterConfig(
        replicas=[u for u in (args.replicas or "").split(",") if u.strip()],
        k8s_service=args.k8s_service,
        k8s_namespace_wide=args.k8s_namespace_wide,
        namespace=args.namespace,
        k8s_port_name=args.k8s_port_name,
        policy=args.policy,
        redis_url=args.redis,
        redis_timeout_ms=args.redis_timeout_ms,
        api_key=args.api_key,
        tenants=tenants,
        max_open_requests=args.max_open_requests,
        body_budget_bytes=args.max_body_bytes_in_flight,
        replica_api_key=args.replica_api_key,
        block_size=args.block_size,
        models=args.model or [None],
        served_model_names=args.served_model_name or [],
        lora_adapter_names=args.lora_adapter_names or [],
        session_header=(args.session_header or "").lower() or None,
        epsilon=args.balance_epsilon,
        ttft_epsilon=args.ttft_balance_epsilon if args.ttft_balance_epsilon >= 0 else None,
        ttft_calibration=args.ttft_calibration,
        max_attempts=args.max_attempts,
        health_interval_s=args.health_interval,
        seed=args.seed,
        chat_cache_tokens=args.chat_cache_tokens,
        tool_call_parser=args.tool_call_parser,
        hold_timeout_s=args.hold_timeout,
        hold_queue=args.hold_queue,
        scale_from_zero=args.scale_from_zero,
        max_queue_wait_s=args.max_queue_wait,
        scheduling_policy=args.scheduling_policy,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        freeze_heap_after_start=True,
    )


def _tenants(args: argparse.Namespace) -> TenantFile | None:
    """--tenants FILE loaded and checked at start: any error stops the router, saying why."""
    if not args.tenants:
        return None
    if args.api_key:
        raise SystemExit("kvscale router: give --tenants or --api-key (or $KVSCALE_API_KEY), "
                         "not both: with --tenants each tenant has its own key")
    try:
        tenants = TenantFile(args.tenants)
    except TenantFileError as exc:
        raise SystemExit(f"kvscale router: --tenants: {exc}") from None
    if tenants.table.limited and not args.redis:
        raise SystemExit("kvscale router: --tenants: requests_per_minute and tokens_per_minute "
                         "are counted in Redis, shared by every router: give --redis")
    return tenants


# The HTTP client's loggers: httpx writes a line per request at INFO (every health check), httpcore
# several per request at DEBUG. ``--log-level debug`` is for the router's own records (every
# decision: kvscale.router.decision), not a trace of the transport under them.
QUIET_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    from kvscale.drain import serve
    from kvscale.router.admission import gate
    from kvscale.router.app import build_app

    configure_logging(args.log_level)
    config = config_from_args(args)
    limits = request_limits.limits_from_args(args)
    app = build_app(config)
    if args.ext_proc_port is not None:
        from kvscale.router.ext_proc import serve_beside

        serve_beside(app, args.host, args.ext_proc_port, limits.max_body_bytes)
    serve(app, app.state.drain, host=args.host, port=args.port, shutdown_timeout_s=args.shutdown_timeout,
          name="kvscale router", log_level=args.log_level, access_log=False, limits=limits,
          gate=gate(config, limits))
    return 0
