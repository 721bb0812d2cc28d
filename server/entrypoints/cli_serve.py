"""`kvscale serve`: the engine behind an OpenAI-compatible HTTP API (flags spelled as vLLM's)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from kvscale import request_limits
from kvscale.base_urls import authority, base_url
from kvscale.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
from kvscale.server.config import KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES
from kvscale.server.engine.cpu_binding import ENV as ENV_OMP_BIND
from kvscale.server.engine.cpu_binding import RESERVE_FROM
from kvscale.server.engine.kv_events_config import kv_events_config_argument
from kvscale.server.entrypoints import responses_store
from kvscale.server.entrypoints.admission import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvscale.server.entrypoints.lora_modules import check_lora_modules, parse_lora_module
from kvscale.server.worker.model_config import FAMILY_DEFAULTS
from kvscale.tokenization import TOOL_FORMATS

logger = logging.getLogger("kvscale.serve")

# Engine flags whose value goes straight into EngineConfig; unset ones keep EngineConfig's default.
_ENGINE_FIELDS = (
    "model", "dtype", "block_size", "enable_prefix_caching", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "num_gpu_blocks_override",
    "kv_cache_memory_bytes", "device", "seed", "quantization",
    "kv_offloading_size", "enforce_eager", "kv_cache_dtype", "async_scheduling", "tensor_parallel_size",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "scheduling_policy",
    "nnodes", "node_rank", "master_addr", "master_port",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="model directory on disk: a Hugging Face checkpoint (config.json and "
                            "safetensors) of one of the families "
                            f"{', '.join(sorted(FAMILY_DEFAULTS))}; or a .gguf file of one of them, "
                            "converted once into $KVSCALE_CACHE "
                            "(default: the bundled SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="name(s) clients use in the `model` field; the first labels metrics "
                            "(default: derived from --model)")
    model.add_argument("--dtype", default=None,
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    model.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                       help="quantize the weights at load: int8 (per-channel weights, per-token "
                            "activations; CPU only)")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="context length (prompt + output) in tokens (default: the model's)")
    model.add_argument("--seed", type=int, default=None)
    model.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default: auto)")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                       help="split the model's heads, MLP and vocabulary over N ranks (processes; "
                            "torch.distributed, gloo on CPU, NCCL on GPUs; every node's with --nnodes), for "
                            "every model family served: N must divide the query heads and the MLP's (and the "
                            "experts') intermediate size; not with --quantization, --enable-lora or "
                            "--speculative-config yet, and on a GPU the KV pool needs "
                            "--num-gpu-blocks-override or --kv-cache-memory-bytes (default 1; docs/engine.md)")
    nodes = parser.add_argument_group("tensor parallel over several nodes (docs/engine.md, \"Ranks on several nodes\")")
    nodes.add_argument("--nnodes", type=int, default=None, metavar="M",
                       help="nodes the --tensor-parallel-size ranks span (it counts them all; a multiple of M): "
                            "node R runs ranks R*N/M.. on; needs $KVSCALE_TP_AUTHKEY, one secret of at "
                            "least 16 bytes on every node (default 1)")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this node's index: 0, the leader, serves HTTP and runs rank 0; others run "
                            "--headless (default 0)")
    nodes.add_argument("--master-addr", default=None, metavar="ADDR",
                       help="the leader's address: torch.distributed meets on --master-port, the steps go "
                            "to the nodes from --master-port + 1 (default 127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=None, metavar="PORT",
                       help="torch.distributed's rendezvous on the leader; the leader takes the other nodes' "
                            "connections on PORT + 1 (default 29500)")
    nodes.add_argument("--headless", action="store_true",
                       help="run only this node's ranks for the leader at --master-addr, no API server; "
                            "exits when the leader goes")
    model.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                       help='speculative decoding without a draft model, vLLM\'s JSON: n-gram (prompt lookup) '
                            '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
                            '"prompt_lookup_min": M} or suffix decoding {"method": "suffix", '
                            '"suffix_decoding_max_tree_depth": D, ...}; other methods (a draft model) are '
                            "refused (docs/server.md)")
    model.add_argument("--enforce-eager", action="store_true", default=None,
                       help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs")
    model.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="queue the next step before this one's tokens are read, so the host's work "
                            "overlaps the GPU's; steps of requests that need the host between tokens "
                            "(sampling, logprobs, penalties, grammars) stay synchronous "
                            "(default: on with a GPU, off on CPU)")

    lora = parser.add_argument_group("LoRA adapters (docs/server.md)")
    lora.add_argument("--enable-lora", action="store_true", default=None,
                      help="serve LoRA adapters: a request's `model` names one (not with "
                           "--tensor-parallel-size > 1 or --quantization yet)")
    lora.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="SPEC",
                      help='adapters as name=path (a PEFT directory) or JSON {"name": ..., "path": ..., '
                           '"base_model_name": ...}')
    lora.add_argument("--max-loras", type=int, default=None,
                      help="adapters resident at once, least recently used out first (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=None,
                      help="the largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory, least recently used out first (read again "
                           "from their path when used; default: --max-loras)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (any path "
                           "this server can read; put it behind --api-key)")

    cache = parser.add_argument_group("KV cache and batching")
    cache.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse KV blocks of shared prompt prefixes (default: on)")
    cache.add_argument("--max-num-seqs", type=int, default=None, help="most sequences per step")
    cache.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens per step")
    cache.add_argument("--scheduling-policy", default=None, choices=list(SCHEDULING_POLICIES),
                       help="fcfs: first come, first served; priority: by each request's `priority` "
                            "(lower first, then arrival), the least urgent preempted first (default fcfs)")
    cache.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="fraction of GPU memory for weights + KV cache (default 0.9)")
    cache.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="exact number of KV blocks (overrides the memory-based sizing)")
    cache.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="KV cache size in bytes (CPU: default 2 GiB)")
    cache.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                       help="what the KV cache stores: auto (the model's dtype) or fp8 (= fp8_e4m3) / "
                            "fp8_e5m2, one byte per value: twice the blocks in the same memory and half "
                            "the bytes for attention to read (CPU only; default auto)")
    cache.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                       help="GiB of host memory for a second KV tier that evicted prefix blocks are "
                            "demoted to and promoted back from; with --tensor-parallel-size N the total "
                            "over the N ranks, each holding 1/N, as vLLM's (default 0: none)")

    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default=None,
                      help="address to bind, and only it (default: every address, IPv4 and IPv6)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("KVSCALE_API_KEY"),
                      help="require `Authorization: Bearer KEY` on the API (default: env KVSCALE_API_KEY)")
    http.add_argument("--max-queue-len", type=int, default=request_limits.DEFAULT_MAX_QUEUE_LEN,
                      help="waiting sequences (prompts times n) beyond which a request gets 503 + "
                           "Retry-After, or 400 when it alone holds more; 0: no limit "
                           f"(default {request_limits.DEFAULT_MAX_QUEUE_LEN})")
    http.add_argument("--request-timeout", type=float, default=0, metavar="SECONDS",
                      help="a non-streamed answer not ready within this gets 504 (request_timeout) "
                           "and its sequences are stopped; streams are not cut (default 0: none)")
    http.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                      help="prompts one /v1/completions request may carry; more get 400 "
                           f"(default {DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    http.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                      help="a streamed answer's events carry at least this many tokens (not the first "
                           "nor the last): fewer, larger events for the server and its clients, at "
                           "the cost of smoothness; a request's stream_interval may ask for more "
                           "(default 1: every token)")
    http.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                      help="on SIGTERM, how long open requests may take to finish while /health and new "
                           f"requests answer 503 (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}: fits a 60 s pod "
                           "grace period with a short preStop)")
    request_limits.add_arguments(http)
    request_limits.add_field_arguments(http)
    http.add_argument("--responses-store", choices=("memory", "redis"), default="memory",
                      help="where stored /v1/responses live: this process's memory, or the --redis every "
                           "replica of the model shares (default memory)")
    http.add_argument("--responses-store-max-entries", type=int, default=responses_store.DEFAULT_MAX_ENTRIES,
                      help="stored /v1/responses kept in this process, the least recently used "
                           f"forgotten first (default {responses_store.DEFAULT_MAX_ENTRIES})")
    http.add_argument("--responses-store-max-bytes", type=int, default=responses_store.DEFAULT_MAX_BYTES,
                      help="bytes of stored /v1/responses in all (default "
                           f"{responses_store.DEFAULT_MAX_BYTES // 2**20} MiB)")
    http.add_argument("--responses-store-ttl", type=float, default=responses_store.DEFAULT_TTL_S,
                      metavar="SECONDS", help="a stored response is forgotten this long after it was "
                                              f"stored (default {responses_store.DEFAULT_TTL_S:g})")
    http.add_argument("--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"])
    http.add_argument("--disable-uvicorn-access-log", action="store_true")

    core = parser.add_argument_group("engine core process")
    core.add_argument("--omp-threads-bind", default=os.environ.get(ENV_OMP_BIND, "auto"), metavar="CPUS",
                      help="CPUs for the engine core's OpenMP threads: auto (one CPU kept for the HTTP "
                           f"front end from {RESERVE_FROM} CPUs on, shared below), nobind, or a list "
                           f"such as 0-2; the front end keeps the others (default: ${ENV_OMP_BIND} or auto)")

    structured = parser.add_argument_group("structured outputs and tool calling")
    structured.add_argument("--structured-outputs-config", type=_structured_outputs_config, default=None,
                            metavar="JSON",
                            help='grammar settings as JSON, e.g. {"compile_timeout_s": 10 (CPU time), '
                                 '"compile_wait_timeout_s": 60 (wall clock), "compile_workers": 1, '
                                 '"compile_priority": "idle", "mask_threads": 1, "fast_forward": false}; '
                                 'backend: "guidance" only (docs/server.md)')
    structured.add_argument("--enable-auto-tool-choice", action="store_true",
                            help='let tool_choice "auto" parse tool calls out of the answer '
                                 "(needs --tool-call-parser)")
    structured.add_argument("--tool-call-parser", default=None, choices=TOOL_FORMATS,
                            help="the tool-call format of the served model's family")

    router = parser.add_argument_group("prefix-aware routing")
    router.add_argument("--redis", default=os.environ.get("KVSCALE_REDIS_URL"), metavar="URL",
                        help="publish KV cache events and load heartbeats to this Redis "
                             "(redis://...; default: $KVSCALE_REDIS_URL)")
    router.add_argument("--replica-id", default=None,
                        help="this replica's id in Redis (default: $POD_NAME, else HOST:PORT)")
    router.add_argument("--kv-events-config", type=kv_events_config_argument, default=None, metavar="JSON",
                        help="also publish KV events in vLLM's format on ZMQ, for llm-d and Dynamo: vLLM's "
                             'KVEventsConfig, e.g. {"enable_kv_cache_events": true, "publisher": "zmq", '
                             '"endpoint": "tcp://*:5557"} (docs/engine.md)')


def _speculative_config(text: str) -> Any:
    from kvscale.server.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config cannot be honoured: {exc}") from exc


def _structured_outputs_config(text: str) -> Any:
    from kvscale.server.config import StructuredOutputsConfig
    from kvscale.server.json_object import parse_json_object

    try:
        return StructuredOutputsConfig(**parse_json_object(text))
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--structured-outputs-config: {exc}") from exc


def advertised_base_url(host: str | None, port: int) -> str:
    """The base URL other machines reach us at: routers dial it and match our heartbeats by it.

    Bound to every address (no --host, or a wildcard), that is the pod's IP (the downward API's
    POD_IP), else the host name.
    """
    if host in (None, "0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostname()
    return base_url(host, port)


@dataclass
class Served:
    """What `kvscale serve` runs: the app and the engine core behind it."""

    app: Any
    core: Any  # EngineCoreClient
    model_name: str
    max_model_len: int
    block_size: int


def build(args: argparse.Namespace) -> Served:
    """Start the engine core process (blocks until it is warmed up) and build the app over it
    (raises ValueError, FileNotFoundError for bad flags or a missing model)."""
    from kvscale.model_files import load_tokenizer, resolve_model_path, served_model_name
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.cpu_binding import split_cpus
    from kvscale.server.engine.engine_core import PublisherSettings
    from kvscale.server.engine.engine_core_client import EngineCoreClient

    fields = {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name) is not None}
    if args.served_model_name:
        fields["served_model_name"] = args.served_model_name[0]
    if args.structured_outputs_config is not None:
        fields["structured_outputs_config"] = args.structured_outputs_config
    if args.speculative_config is not None:
        fields["speculative_config"] = args.speculative_config
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    lora_modules = list(args.lora_modules or [])
    fields["lora_modules"] = {m.name: os.path.abspath(m.path) for m in lora_modules}
    config = EngineConfig(**fields)
    model_path = resolve_model_path(args.model)
    served_names = list(args.served_model_name or [served_model_name(config.model, None)])
    check_lora_modules(lora_modules, served_names)
    cpus = split_cpus(os.sched_getaffinity(0), args.omp_threads_bind)
    logger.info("CPUs: engine core %s, HTTP front end %s (%s)",
                ",".join(map(str, cpus.core)) if cpus.core else "unpinned",
                ",".join(map(str, cpus.front)) if cpus.front else "shares the core's" if cpus.core else "unpinned",
                cpus.why)

    advertised = advertised_base_url(args.host, args.port)
    publisher = None
    if args.redis:
        replica_id = args.replica_id or os.environ.get("POD_NAME") or authority(advertised)
        publisher = PublisherSettings(redis_url=args.redis, replica_id=replica_id,
                                      model_name=served_names[0], base_url=advertised)
    store: Any = responses_store.MemoryResponseStore(args.responses_store_max_entries,
                                                     args.responses_store_max_bytes, args.responses_store_ttl)
    if args.responses_store == "redis":
        from kvscale.server.entrypoints.responses_store_redis import RedisResponseStore

        store = RedisResponseStore(args.redis, served_names[0], args.responses_store_max_entries,
                                   args.responses_store_max_bytes, args.responses_store_ttl)
    def load_front_end() -> Any:
        # Called while the core imports torch and builds its engine: the app's imports and the
        # tokenizer then take no wall time where a second CPU is free (a cold start from zero).
        import kvscale.server.entrypoints.api_server  # noqa: F401 - imported now, used below

        return load_tokenizer(model_path)

    core = EngineCoreClient.launch(config, load_tokenizer=load_front_end, cpus=cpus, publisher=publisher,
                                   kv_events=args.kv_events_config)
    from kvscale.server.entrypoints.api_server import build_app

    tokenizer, ready = core.tokenizer, core.ready
    app = build_app(core, tokenizer=tokenizer, served_model_names=served_names,
                    max_model_len=ready.max_model_len, api_key=args.api_key,
                    max_queue_len=args.max_queue_len or None,
                    max_prompts_per_request=args.max_prompts_per_request,
                    field_limits=request_limits.field_limits_from_args(args),
                    model_root=str(model_path),
                    vocab_size=min(len(tokenizer), ready.vocab_size),
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    stream_interval=args.stream_interval, response_store=store, lora_modules=lora_modules,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                    scheduling_policy=config.scheduling_policy,
                    request_timeout_s=args.request_timeout or None)
    return Served(app, core, ready.model_name, ready.max_model_len, ready.block_size)


def run(args: argparse.Namespace) -> int:
    if args.headless:
        from kvscale.server.worker.tp_headless import run_headless

        return run_headless(args)
    if args.max_queue_len is not None and args.max_queue_len < 0:
        print("kvscale serve: --max-queue-len must be non-negative", file=sys.stderr)
        return 2
    if args.request_timeout < 0:
        print("kvscale serve: --request-timeout must be non-negative", file=sys.stderr)
        return 2
    try:
        limits = request_limits.limits_from_args(args)
        request_limits.field_limits_from_args(args)
    except SystemExit as exc:
        print(f"kvscale serve: {exc}", file=sys.stderr)
        return 2
    if args.max_prompts_per_request < 1:
        print("kvscale serve: --max-prompts-per-request must be at least 1", file=sys.stderr)
        return 2
    if args.stream_interval < 1:
        print("kvscale serve: --stream-interval must be at least 1", file=sys.stderr)
        return 2
    if min(args.responses_store_max_entries, args.responses_store_max_bytes) < 1 or args.responses_store_ttl <= 0:
        print("kvscale serve: --responses-store-max-entries and --responses-store-max-bytes must be at "
              "least 1, --responses-store-ttl positive", file=sys.stderr)
        return 2
    if args.responses_store == "redis" and not args.redis:
        print("kvscale serve: --responses-store redis needs --redis URL", file=sys.stderr)
        return 2
    if args.shutdown_timeout < 0:
        print("kvscale serve: --shutdown-timeout must be non-negative", file=sys.stderr)
        return 2
    from kvscale.drain import serve
    from kvscale.processes import freeze_startup_heap

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        served = build(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvscale serve: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"kvscale serve: the engine core failed to start: {exc}", file=sys.stderr)
        return 1
    where = f"{base_url(args.host, args.port)}/v1" if args.host else f"port {args.port} of every address"
    name = args.served_model_name[0] if args.served_model_name else served.model_name
    print(f"kvscale: serving {name!r} at {where} (max_model_len {served.max_model_len}, block size "
          f"{served.block_size}, engine core pid {served.core.pid})", flush=True)
    freeze_startup_heap()  # the model and tokenizer are loaded: spare them every full GC
    serve(served.app, served.app.state.drain, host=args.host, port=args.port,
          shutdown_timeout_s=args.shutdown_timeout, name="kvscale serve",
          log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
          limits=limits)
    return 0
