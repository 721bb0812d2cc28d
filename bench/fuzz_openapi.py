"""Fuzzing pass: schemathesis against `kvscale serve` and a `kvscale router` in front of it.

Starts one replica of the bundled model and one router over it, both with an API key, reads the
server's /openapi.json (behind the key) and, for every operation in it, sends requests generated
in both of schemathesis' modes (positive: valid by the schema; negative: invalid), each set once
with the key and once without, first to the replica, then to the router. No answer is
asserted: every status is counted, so that one run gives the whole picture.

Reported (JSON, ``--out``), per target (``server``, ``router``):
- ``calls`` and ``by_status``: requests sent and their answers' statuses (0: no answer at all);
- ``server_errors``: answers >= 500 (target 0), with examples;
- ``malformed_errors``: API errors (4xx on /v1/, /tokenize, /detokenize) without the OpenAI
  error JSON (target 0);
- ``not_generated``: operations schemathesis could generate nothing for in a mode (a GET without
  parameters has no invalid input);
- ``rss_mib``: each process's resident memory before and after the target's pass;
and ``processes_alive`` at the end (target: all), ``targets_met``.

    .venv/bin/python -m bench.fuzz_openapi --max-examples 50 --out bench/results/fuzz_openapi.json

Its request generation (``cheap``, ``run_cases``) is shared with the suite's fuzz tests
(tests/openapi_fuzz.py imports it).
"""

from __future__ import annotations

import argparse
import functools
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a file (`python bench/fuzz_openapi.py`): its siblings import as bench.*.
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import hypothesis  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

# Paths whose errors carry the OpenAI error JSON (others, like a router's unknown path, need not).
API_PATHS = ("/v1/", "/tokenize", "/detokenize")
ERROR_KEYS = {"message", "type", "param", "code"}


def cheap(case: Any) -> None:
    """Keep generation cheap: validation and routing are under test, not generation speed."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None and body.get(
            "max_completion_tokens") is None:
        body["max_tokens"] = 4  # unset means "up to the context length": far too slow here
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4  # /v1/responses: the same
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]


def run_cases(operation: Any, mode: GenerationMode, max_examples: int, each: Callable[[Any], None]) -> None:
    """``each`` on up to ``max_examples`` cases generated for ``operation``, made cheap first;
    derandomized, so two runs send the same requests."""
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case: Any) -> None:
        cheap(case)
        each(case)

    check()


def is_openai_error(path: str, status: int, body: Any) -> bool:
    """Whether an answer is fine by the error contract: only API errors must be the OpenAI JSON."""
    if status < 400 or not path.startswith(API_PATHS):
        return True
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == ERROR_KEYS


# The replica as `kvscale up` starts one, small, with tool calling on so that its paths are fuzzed too.
SERVER_FLAGS = ("--max-model-len", "512", "--max-num-seqs", "8", "--num-gpu-blocks-override", "256",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log")


def _status_field(pid: int, field: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split()[1]
    except OSError:
        return None
    return None


def rss_mib(pid: int) -> float | None:
    kib = _status_field(pid, "VmRSS")
    return round(int(kib) / 1024, 1) if kib else None


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a dead child not yet reaped still has its /proc entry)."""
    state = _status_field(pid, "State")
    return state is not None and state != "Z"


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def child_name(pid: int) -> str:
    """A `kvscale serve` child by what it runs: the engine core, or a helper of multiprocessing's."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return f"server_child_{pid}"
    if "resource_tracker" in argv:
        return "server_resource_tracker"
    return "engine_core" if "spawn_main" in argv else f"server_child_{pid}"


class FuzzPlatform:
    """One `kvscale serve` and one `kvscale router` over it, both requiring ``api_key``."""

    server_flags = list(SERVER_FLAGS)

    def __init__(self, api_key: str, startup_timeout: float) -> None:
        from kvscale.router.cli_up import Stack

        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.stack = Stack()
        self.logdir = self.stack.logdir
        self.server_url = self.router_url = ""
        self.pids: dict[str, int] = {}

    def start(self) -> None:
        from kvscale.processes import free_port

        kvscale = [sys.executable, "-m", "kvscale"]
        port = free_port()
        self.server_url = f"http://127.0.0.1:{port}"
        # Keys by environment, not argv: Stack.spawn's rule for secrets.
        server = self.stack.spawn("server", kvscale + ["serve", "--host", "127.0.0.1", "--port", str(port),
                                                       *SERVER_FLAGS], self.server_url,
                                  f"{self.server_url}/health", env_extra={"KVSCALE_API_KEY": self.api_key})
        self.stack.wait_healthy([server], self.startup_timeout)
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        router = self.stack.spawn("router", kvscale + [
            "router", "--host", "127.0.0.1", "--port", str(port), "--replicas", self.server_url,
            "--health-interval", "0.5", "--log-level", "warning"], self.router_url, f"{self.router_url}/health",
            env_extra={"KVSCALE_API_KEY": self.api_key, "KVSCALE_REPLICA_API_KEY": self.api_key})
        self.stack.wait_healthy([router], self.startup_timeout)
        self.pids = {"server": server.proc.pid, "router": router.proc.pid}
        for pid in children_of(server.proc.pid):
            self.pids[child_name(pid)] = pid

    def rss_mib(self) -> dict[str, float | None]:
        return {name: rss_mib(pid) for name, pid in self.pids.items()}

    def alive(self) -> dict[str, bool]:
        return {name: is_running(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.stack.stop(grace_s=20)


class Tally:
    """One target's answers."""

    def __init__(self) -> None:
        self.by_status: Counter = Counter()
        self.by_operation: Counter = Counter()
        self.server_errors: list[str] = []
        self.malformed: list[str] = []
        self.no_answer: list[str] = []
        self.not_generated: list[str] = []

    def record(self, operation: Any, case: Any, *, base_url: str, headers: dict[str, str]) -> None:
        self.by_operation[operation.label] += 1
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=120)
        except Exception as exc:  # noqa: BLE001 - a transport failure is a finding, not a crash
            self.by_status[0] += 1
            self.no_answer.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        status = response.status_code
        self.by_status[status] += 1
        if status >= 500:
            self.server_errors.append(f"{operation.label} {str(case.body)[:300]!r} -> {status} {response.text[:300]}")
        try:
            body = response.json()
        except ValueError:
            body = None
        if not is_openai_error(operation.path, status, body):
            self.malformed.append(f"{operation.label} -> {status} {response.text[:200]}")

    def as_dict(self) -> dict[str, Any]:
        return {"calls": sum(self.by_status.values()),
                "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                "by_operation": dict(sorted(self.by_operation.items())),
                "server_errors": len(self.server_errors), "server_error_examples": self.server_errors[:5],
                "malformed_errors": len(self.malformed), "malformed_error_examples": self.malformed[:5],
                "no_answer": len(self.no_answer), "no_answer_examples": self.no_answer[:5],
                "not_generated": self.not_generated}


def fuzz_target(operations: list[Any], base_url: str, header_sets: list[dict[str, str]],
                max_examples: int) -> Tally:
    tally = Tally()
    for operation in operations:
        for headers in header_sets:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                try:
                    run_cases(operation, mode, max_examples,
                              functools.partial(tally.record, operation, base_url=base_url, headers=headers))
                except Exception as exc:  # noqa: BLE001 - e.g. nothing invalid to generate for a GET
                    tally.not_generated.append(f"{operation.label} {mode.value}"
                                               f"{' with key' if headers else ''}: {type(exc).__name__}")
    return tally


def _main(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import schemathesis
    from schemathesis.core.result import Ok

    from bench.common import machine
    from bench.roofline import cpu_isa

    api_key = "sk-fuzz-" + secrets.token_urlsafe(12)
    auth = {"Authorization": f"Bearer {api_key}"}
    platform_ = FuzzPlatform(api_key, args.startup_timeout)
    try:
        platform_.start()
        schema = schemathesis.openapi.from_url(f"{platform_.server_url}/openapi.json", headers=auth)
        operations, invalid = [], []
        for result in schema.get_all_operations():
            if isinstance(result, Ok):
                operations.append(result.ok())
            else:  # an operation schemathesis cannot read: reported, as it goes unfuzzed
                invalid.append(str(result.err())[:300])
        targets: dict[str, Any] = {}
        for target, url in (("server", platform_.server_url), ("router", platform_.router_url)):
            before = platform_.rss_mib()
            started = time.monotonic()
            tally = fuzz_target(operations, url, [auth, {}], args.max_examples)
            targets[target] = {**tally.as_dict(), "wall_s": round(time.monotonic() - started, 1),
                               "rss_mib": {name: {"before": mib, "after": platform_.rss_mib().get(name)}
                                           for name, mib in before.items()}}
        alive = platform_.alive()
        healthy = {name: httpx.get(f"{url}/health", timeout=10).status_code == 200
                   for name, url in (("server", platform_.server_url), ("router", platform_.router_url))
                   if alive.get(name)}
    finally:
        platform_.stop()
    return {
        "command": " ".join(["bench/fuzz_openapi.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "isa": cpu_isa()},
        "config": {"max_examples": args.max_examples, "modes": ["positive", "negative"],
                   "header_sets": ["with the key", "without"], "server_flags": platform_.server_flags,
                   "operations": [op.label for op in operations], "unreadable_operations": invalid},
        "targets": targets,
        "processes_alive": alive,
        "healthy_at_end": healthy,
        "targets_met": {
            "no_server_errors": all(t["server_errors"] == 0 for t in targets.values()),
            "openai_error_json": all(t["malformed_errors"] == 0 for t in targets.values()),
            "every_call_answered": all(t["no_answer"] == 0 for t in targets.values()),
            "processes_alive": all(alive.values()) and all(healthy.values()),
            "every_operation_fuzzed": not invalid,
        },
        "logs": platform_.logdir,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=50,
                        help="requests per operation, mode and key setting, per target")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", default=None, help="default: bench/results/fuzz_openapi.json")
    args = parser.parse_args(argv)
    from bench.common import exit_on_sigterm, write_result

    exit_on_sigterm()
    result = _main(args)
    path = write_result("fuzz_openapi", result, args.out)
    summary = {target: {k: figures[k] for k in ("calls", "by_status", "server_errors", "malformed_errors",
                                                "no_answer", "wall_s")}
               for target, figures in result["targets"].items()}
    print(f"{path}\n{summary}\nprocesses_alive={result['processes_alive']} targets_met={result['targets_met']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
