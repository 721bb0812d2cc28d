"""`kvscale up --replicas N`: Redis, N replicas of a model and the router on this machine.

Every child is started by this process and stopped by it: Ctrl-C or SIGTERM stops the router
first (no new requests), then the replicas, then Redis; a child that ignores SIGTERM for a few
seconds is killed. On Linux each child also gets PR_SET_PDEATHSIG, so even a SIGKILL of
`kvscale up` leaves no orphans behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvscale.processes import die_with_parent, free_port, port_open, wait_for_port, wait_until
from kvscale.router.policy import DEFAULT_POLICY, POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="number of `kvscale serve` replicas")
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    parser.add_argument("--port", type=int, default=8080, help="router port")
    parser.add_argument("--replica-base-port", type=int, default=0, help="first replica port (0: free ports)")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV blocks per replica")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                        help="GiB of host memory per replica for a second KV tier (as `kvscale serve`)")
    parser.add_argument("--hold-timeout", type=float, default=None, metavar="SECONDS",
                        help="start the router first: it takes requests at once and holds them up to "
                             "this long for a replica to be ready (as `kvscale router`)")
    parser.add_argument("--api-key", default=os.environ.get("KVSCALE_API_KEY"),
                        help="key for router and replicas (with --tenants: the replicas' only, sent by the router)")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="the router's tenants file (as `kvscale router --tenants`): a key per tenant")
    parser.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                        help="requests wait in the router while the replicas are full (as `kvscale router`)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="SPEC",
                        help="LoRA adapters every replica serves, name=path or vLLM's JSON (they get --enable-lora)")
    parser.add_argument("--no-redis", action="store_true", help="skip Redis: the router indexes in-process")
    parser.add_argument("--startup-timeout", type=float, default=600.0)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when `kvscale up` dies, however it dies."""
    die_with_parent()
    # Ctrl-C goes to the whole foreground group; children wait for our orderly SIGTERM instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def lora_module_name(spec: str) -> str:
    """The adapter's name in a ``--lora-modules`` value (``name=path`` or JSON with ``name``), for
    the router's --lora-adapter-names; the replicas check the rest of it."""
    if spec.lstrip().startswith("{"):
        try:
            name = json.loads(spec).get("name")
        except (json.JSONDecodeError, AttributeError):
            name = None
    else:
        name = spec.partition("=")[0] if "=" in spec else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"--lora-modules {spec!r} must be name=path or a JSON object with a name")
    return name


def router_keys(api_key: str | None, tenants: str | None) -> dict[str, str | None]:
    """The router's key variables (None: not inherited from this process's environment). With
    --tenants the tenants' keys admit clients and the router refuses $KVSCALE_API_KEY beside them
    (docs/router.md, "Tenants"); --api-key then guards the replicas, which trust the tenant the
    router names only from a client holding their key."""
    if tenants:
        return {"KVSCALE_API_KEY": None, "KVSCALE_REPLICA_API_KEY": api_key}
    return {"KVSCALE_API_KEY": api_key, "KVSCALE_REPLICA_API_KEY": api_key} if api_key else {}


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: str
    health_url: str | None

    def alive(self) -> bool:
        return self.proc.poll() is None


class Stack:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.logdir = tempfile.mkdtemp(prefix="kvscale-up-")

    def spawn(self, name: str, argv: list[str], url: str, health_url: str | None,
              env_extra: Mapping[str, str | None] | None = None) -> Child:
        """``env_extra``: what the child gets in its environment (secrets: never in ``argv``,
        which every local user can read in /proc); None unsets a variable."""
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")  # noqa: SIM115 - lives with the child
        env = dict(os.environ)
        for variable, value in (env_extra or {}).items():
            if value is None:
                env.pop(variable, None)
            else:
                env[variable] = value
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        child = Child(name, proc, url, health_url)
        self.children.append(child)
        return child

    def wait_healthy(self, children: list[Child], timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        pending = list(children)
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise RuntimeError(
                        f"{child.name} exited with code {child.proc.returncode}; "
                        f"see {os.path.join(self.logdir, child.name + '.log')}"
                    )
                if child.health_url is None:
                    pending.remove(child)
                    continue
                try:
                    if httpx.get(child.health_url, timeout=1.0).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {', '.join(c.name for c in pending)}")
            if pending:
                time.sleep(0.3)

    def wait_listening(self, child: Child, host: str, port: int, timeout: float) -> None:
        """Until ``child`` accepts connections (it may still answer 503), or it exits."""
        wait_until(lambda: not child.alive() or port_open(host, port), timeout,
                   what=f"{child.name} to listen on {host}:{port}")
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}; "
                               f"see {os.path.join(self.logdir, child.name + '.log')}")

    def stop(self, grace_s: float = 10.0) -> None:
        # Reverse start order: router, replicas, then Redis.
        for child in reversed(self.children):
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                child.proc.kill()
            child.proc.wait()


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        print("kvscale up: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        adapters = [lora_module_name(spec) for spec in args.lora_modules or ()]
    except ValueError as exc:
        print(f"kvscale up: {exc}", file=sys.stderr)
        return 2
    kvscale = [sys.executable, "-m", "kvscale"]
    stack = Stack()
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        redis_url = None
        redis_binary = None if args.no_redis else shutil.which("redis-server")
        if redis_binary:
            port = free_port()
            stack.spawn(
                "redis",
                [redis_binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", stack.logdir],
                f"redis://127.0.0.1:{port}/0",
                None,
            )
            wait_for_port(port, 10, what="redis-server")
            redis_url = f"redis://127.0.0.1:{port}/0"
            print(f"kvscale up: redis-server at {redis_url}", flush=True)
        else:
            why = "--no-redis" if args.no_redis else "no redis-server on the PATH"
            print(f"kvscale up: {why}; the router keeps its prefix index in process "
                  "(built from its own routing decisions, no KV events)", flush=True)

        replica_children = []
        for i in range(args.replicas):
            port = args.replica_base_port + i if args.replica_base_port else free_port()
            url = f"http://127.0.0.1:{port}"
            argv = kvscale + ["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size)]
            if args.model:
                argv += ["--model", args.model]
            for flag, value in (("--num-gpu-blocks-override", args.num_gpu_blocks_override),
                                ("--max-model-len", args.max_model_len), ("--max-num-seqs", args.max_num_seqs),
                                ("--kv-offloading-size", args.kv_offloading_size)):
                if value is not None:
                    argv += [flag, str(value)]
            if args.lora_modules:
                argv += ["--enable-lora", "--lora-modules", *args.lora_modules]
            if redis_url:
                # Stored /v1/responses shared too, so a conversation continues on any replica.
                argv += ["--redis", redis_url, "--replica-id", f"replica-{i}", "--responses-store", "redis"]
            replica_children.append(stack.spawn(f"replica-{i}", argv, url, f"{url}/health", env_extra=(
                {"KVSCALE_API_KEY": args.api_key} if args.api_key else None)))
        print(f"kvscale up: starting {args.replicas} replica(s) (logs in {stack.logdir})", flush=True)
        router_url = f"http://{args.host}:{args.port}"
        argv = kvscale + ["router", "--host", args.host, "--port", str(args.port), "--policy", args.policy,
                          "--block-size", str(args.block_size),
                          "--replicas", ",".join(c.url for c in replica_children)]
        if args.model:
            argv += ["--model", args.model]
        if redis_url:
            argv += ["--redis", redis_url]
        if args.hold_timeout is not None:
            argv += ["--hold-timeout", str(args.hold_timeout)]
        if adapters:
            argv += ["--lora-adapter-names", *adapters]
        if args.tenants:
            argv += ["--tenants", args.tenants]
        if args.max_queue_wait is not None:
            argv += ["--max-queue-wait", str(args.max_queue_wait)]
        keys = router_keys(args.api_key, args.tenants)
        health_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host

        def start_router() -> Child:
            return stack.spawn("router", argv, router_url, f"http://{health_host}:{args.port}/health",
                               env_extra=keys)

        if args.hold_timeout is None:
            stack.wait_healthy(replica_children, args.startup_timeout)
            stack.wait_healthy([start_router()], args.startup_timeout)
        else:
            # Requests are taken (and held) while the replicas load, as a service scaling from zero.
            router = start_router()
            stack.wait_listening(router, health_host, args.port, args.startup_timeout)
            print(f"kvscale up: router at {router_url}/v1 holds requests until a replica is ready",
                  flush=True)
            stack.wait_healthy(replica_children, args.startup_timeout)
            stack.wait_healthy([router], args.startup_timeout)

        print("kvscale up: ready", flush=True)
        print(f"  router:   {router_url}/v1", flush=True)
        for child in replica_children:
            print(f"  {child.name}: {child.url}/v1", flush=True)
        if redis_url:
            print(f"  redis:     {redis_url}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while True:
            for child in stack.children:
                if not child.alive():
                    print(f"kvscale up: {child.name} exited with code {child.proc.returncode}; stopping",
                          file=sys.stderr, flush=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("kvscale up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvscale up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        print("kvscale up: all stopped", flush=True)
