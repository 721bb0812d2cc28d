"""`kvscale operator`: run the InferenceService operator (kopf) against a cluster;
`kvscale operator render-router`: print the namespace-wide router (render_router.py)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket
import threading
import time
import uuid

from kvscale.operator import render_router
from kvscale.operator.spec import DEFAULT_IMAGE, DEFAULT_REDIS_IMAGE, DEFAULT_ROUTER_IMAGE


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch only this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (default: in-cluster service account, then $KUBECONFIG)")
    parser.add_argument("--context", default=None, help="kubeconfig context")
    parser.add_argument("--resync-interval", type=float, default=10.0, metavar="S",
                        help="seconds between full reconciliations of each InferenceService")
    parser.add_argument("--scrape-interval", type=float, default=5.0, metavar="S",
                        help="seconds between metric scrapes and autoscaling decisions")
    parser.add_argument("--scrape-timeout", type=float, default=2.0, metavar="S",
                        help="deadline of one pod's whole /metrics or router /health answer")
    parser.add_argument("--scrape-max-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                        help="largest /metrics or router /health body read; a larger one is refused")
    parser.add_argument("--allow-metrics-url-override", action="store_true",
                        default=_env_flag("KVSCALE_ALLOW_METRICS_URL_OVERRIDE"),
                        help="honour the pod annotation serving.kvscale.io/metrics-url "
                             "(env KVSCALE_ALLOW_METRICS_URL_OVERRIDE=1)")
    parser.add_argument("--cluster-domain", default="cluster.local",
                        help="cluster DNS domain used in status.url")
    images = parser.add_argument_group("images the operator runs")
    images.add_argument("--engine-image", default=DEFAULT_IMAGE,
                        help="image of `kvscale serve` pods whose InferenceService names no spec.image")
    images.add_argument("--router-image", default=DEFAULT_ROUTER_IMAGE,
                        help="image of `kvscale router` pods (the control-plane image)")
    images.add_argument("--redis-image", default=DEFAULT_REDIS_IMAGE,
                        help="image of the Redis the operator runs for an InferenceService's KV index")
    images.add_argument("--allowed-image", action="append", default=[], metavar="REPO",
                        help="a repository an InferenceService's spec.image may name, at any tag or "
                             "digest (repeatable; none: any image; the three above always)")
    images.add_argument("--allowed-api-key-secret", action="append", default=[], metavar="PATTERN",
                        help="a name (shell pattern) an InferenceService's apiKeySecretRef may name "
                             "(repeatable; none: any Secret)")
    parser.add_argument("--server-default-arg", action="append", default=[], metavar="ARG",
                        help="a `kvscale serve` argument every server gets, as a container's args "
                             "(--name=value, or --name then its value; repeatable, in order); an "
                             "InferenceService's engine.extraArgs setting the same flag wins")
    election = parser.add_argument_group("leader election (one active operator per cluster)")
    election.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                          help="hold a Lease before reconciling, so replicas never fight")
    election.add_argument("--leader-election-namespace", default=None,
                          help="namespace of the Lease (default: $POD_NAMESPACE, the service "
                               "account's namespace, else default)")
    election.add_argument("--leader-election-id", default="kvscale-operator", help="Lease name")
    election.add_argument("--lease-duration", type=float, default=15.0, metavar="S")
    election.add_argument("--renew-deadline", type=float, default=10.0, metavar="S")
    election.add_argument("--retry-period", type=float, default=2.0, metavar="S")
    election.add_argument("--identity", default=None,
                          help="this replica's name in the Lease (default: $POD_NAME or host + id)")
    parser.add_argument("--metrics-port", type=int, default=8081, metavar="PORT",
                        help="serve the operator's Prometheus metrics at :PORT/metrics, and /healthz "
                             "for liveness (503 once its working loop is stuck; 0: off)")
    parser.add_argument("--metrics-host", default=None,
                        help="address for --metrics-port, and only it (default: every address, IPv4 and IPv6)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    about = "print the namespace-wide router's objects (the chart's template with --helm)"
    render = actions.add_parser("render-router", help=about, description=about)
    render_router.add_arguments(render)


def run(args: argparse.Namespace) -> int:
    if args.action == "render-router":
        return render_router.run(args)
    import kopf

    from kvscale.base_urls import base_url
    from kvscale.listen import all_addresses_host
    from kvscale.operator import periodic, probes, registration
    from kvscale.operator.config import config_from_args
    from kvscale.operator.kube import Kube, load_connection
    from kvscale.operator.leader import LeaderElector
    from kvscale.operator.metrics import OperatorMetrics
    from kvscale.operator.runtime import Runtime
    from kvscale.operator.spec import GROUP

    kopf.configure(verbose=args.verbose)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2` prints every stack
    if not args.verbose:
        # Per-request and per-handler success lines every few seconds drown what matters.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    log = logging.getLogger("kvscale.operator")
    connection = load_connection(args.kubeconfig, args.context)
    kube = Kube(connection)
    config = config_from_args(args)
    if config.allow_metrics_url_override:
        log.warning("honouring pod annotation serving.kvscale.io/metrics-url for scrape addresses")

    registry = kopf.OperatorRegistry()
    registration.register(registry)

    @kopf.on.login(registry=registry)
    def login(**_: object) -> kopf.ConnectionInfo:
        # kopf logs in again after a 401: the service-account token file is read afresh then.
        scheme, _space, token = (connection.token or "").partition(" ")
        if connection.token_file:
            scheme, token = "Bearer", connection.current_token() or ""
        return kopf.ConnectionInfo(
            server=connection.server, ca_path=connection.ca_path, insecure=connection.insecure,
            certificate_path=connection.cert_path, private_key_path=connection.key_path,
            scheme=(scheme or None) if token else None, token=(token or scheme or None),
            default_namespace=connection.default_namespace,
        )

    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Serve only what exists at start-up: no list/watch of CRDs and namespaces is needed (RBAC).
    settings.scanning.disabled = True
    settings.execution.max_workers = 16
    settings.posting.level = logging.INFO

    # Before the election, so a standby answers scrapes and probes too (with no per-service
    # series); its heartbeat is the election's until it leads, then the kopf loop's.
    operator_metrics = OperatorMetrics()
    heartbeat = probes.Heartbeat()
    if args.metrics_port:
        metrics_host = args.metrics_host or all_addresses_host()
        probes.serve(args.metrics_port, metrics_host, operator_metrics.registry, heartbeat)
        log.info("metrics at %s/metrics", base_url(metrics_host, args.metrics_port))

    identity = args.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    elector = None
    if args.leader_elect:
        namespace = (args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
                     or connection.default_namespace)
        elector = LeaderElector(kube, namespace, args.leader_election_id, identity,
                                args.lease_duration, args.renew_deadline, args.retry_period)
        try:
            if not elector.acquire(threading.Event(), on_attempt=lambda: heartbeat.beat("leader election")):
                return 1
        except KeyboardInterrupt:
            return 130

    stop_holding = threading.Event()
    lost = threading.Event()
    memo = kopf.Memo()
    memo.runtime = Runtime(kube=kube, config=config, metrics=operator_metrics)
    heartbeat.add_check(lambda: periodic.stalled(memo.runtime, time.monotonic()))

    async def operate() -> None:
        # An asyncio stop flag: kopf waits for a threading one in an executor thread, which
        # then keeps the process from exiting after SIGTERM.
        loop = asyncio.get_running_loop()
        stop_flag = asyncio.Event()

        def hold() -> None:
            assert elector is not None
            if not elector.hold(stop_holding):
                lost.set()
                loop.call_soon_threadsafe(stop_flag.set)

        if elector is not None:
            threading.Thread(target=hold, name="lease-holder", daemon=True).start()
        beating = asyncio.create_task(probes.beat_forever(heartbeat), name="liveness-heartbeat")
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                stop_flag=stop_flag,
                memo=memo,
            )
        finally:
            beating.cancel()

    try:
        asyncio.run(operate())
    except asyncio.CancelledError:
        pass
    finally:
        stop_holding.set()
        if elector is not None and not lost.is_set():
            elector.release()
        kube.close()
    if lost.is_set():
        log.error("leadership lost; exiting so that a fresh start can campaign again")
        return 1
    return 0
