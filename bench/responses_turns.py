"""Multi-turn /v1/responses conversations through the router over two replicas: each turn after
the first continues the previous one by ``previous_response_id``. Per turn: whether it was
answered, the replica that answered, the router's predicted hit tokens, and the replica's own
prefix-cache hit (``usage.input_tokens_details.cached_tokens`` of ``input_tokens``).

The target: every turn answered, and from the second turn on a prefix hit rate (cached tokens ÷
input tokens, over those turns) of at least 0.9.

    python -m bench.responses_turns --conversations 4 --turns 4

Starts `kvscale up --replicas 2` (Redis, two replicas storing responses in it, the router with
its default policy) and writes ``bench/results/responses_turns.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import openai

from bench.common import REPO, machine, write_result
from bench.roofline import cpu_isa
from kvscale.processes import die_with_parent, free_port, wait_until

# A long opening (a document to answer from), so the turns after it are mostly history, as an
# agent's or a chat's are.
OPENING = (
    "You keep the harbour log of the North Point lighthouse. Here is tonight's log. "
    + " ".join(f"At {h:02d}:{m:02d} the {name} passed heading {heading}, flying the flag of {flag}, "
               f"in {weather}." for h, m, name, heading, flag, weather in [
                   (19, 5, "Albatross", "north", "Norway", "light rain"),
                   (19, 40, "Marguerite", "south", "France", "fog"),
                   (20, 15, "Stella Maris", "east", "Italy", "fog"),
                   (21, 2, "Kestrel", "west", "Ireland", "clear skies"),
                   (22, 30, "Nordlys", "north", "Denmark", "strong wind"),
                   (23, 11, "Santa Clara", "south", "Spain", "drizzle"),
                   (23, 58, "Ostsee", "east", "Germany", "fog")])
    + " Answer the keeper's questions from the log, briefly."
)
QUESTIONS = ["Which ship passed first?", "Which ships passed in fog?", "Which flag did the Kestrel fly?",
             "What was the weather at 22:30?", "Which ship passed last?", "How many ships headed north?"]


def start_fleet(port: int, log_dir: str) -> subprocess.Popen:
    log = open(os.path.join(log_dir, "up.log"), "wb")  # noqa: SIM115 - held by the child
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "kvscale", "up", "--replicas", "2", "--port", str(port)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)  # a bench stopped from outside leaves no fleet
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"kvscale up exited with {proc.returncode}: see {log.name}")
        try:
            health = httpx.get(f"{url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return sum(r["healthy"] for r in health.get("replicas", [])) == 2

    wait_until(ready, 600, interval=0.5, what="the router and both replicas")
    return proc


def conversation(client: openai.OpenAI, model: str, number: int, turns: int, stream: bool,
                 max_output_tokens: int) -> list[dict]:
    """One conversation. Its ``instructions`` (sent every turn, as agents resend theirs) name its
    number, so conversations differ from their first block and spread over the replicas."""
    out: list[dict[str, Any]] = []
    previous: str | None = None
    for turn in range(turns):
        fields: dict[str, Any] = {
            "instructions": f"You keep log book {number} of the North Point lighthouse.",
            "input": f"{OPENING} {QUESTIONS[0]}" if turn == 0 else QUESTIONS[turn % len(QUESTIONS)]}
        if previous is not None:
            fields["previous_response_id"] = previous
        started = time.perf_counter()
        raw = client.responses.with_raw_response.create(model=model, max_output_tokens=max_output_tokens,
                                                        temperature=0, stream=stream, **fields)
        parsed: Any = raw.parse()
        # A stream's last event (response.completed or .incomplete) carries the whole response.
        response: Any = list(parsed)[-1].response if stream else parsed
        usage = response.usage
        out.append({
            "turn": turn + 1, "stream": stream, "status": response.status,
            "answered": response.status in ("completed", "incomplete") and bool(response.output_text),
            "replica": raw.headers.get("x-kvscale-replica"),
            "predicted_hit_tokens": int(raw.headers.get("x-kvscale-predicted-hit-tokens", 0)),
            "input_tokens": usage.input_tokens, "cached_tokens": usage.input_tokens_details.cached_tokens,
            "output_tokens": usage.output_tokens, "seconds": round(time.perf_counter() - started, 3),
        })
        previous = response.id
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4, help="half of them streamed")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvscale-responses-turns-") as log_dir:
        proc = start_fleet(port, log_dir)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=600)
            model = client.models.list().data[0].id
            conversations = [conversation(client, model, i + 1, args.turns, i % 2 == 1, args.max_output_tokens)
                             for i in range(args.conversations)]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)

    later = [t for c in conversations for t in c if t["turn"] > 1]
    hit_rate = sum(t["cached_tokens"] for t in later) / max(1, sum(t["input_tokens"] for t in later))
    result = {
        "what": "multi-turn /v1/responses through the router over 2 replicas, previous_response_id each turn",
        "command": " ".join(["python -m bench.responses_turns", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine(), "cpu": cpu_isa()},
        "turns": args.turns, "conversations": args.conversations, "max_output_tokens": args.max_output_tokens,
        "every_turn_answered": all(t["answered"] for c in conversations for t in c),
        "later_turns_on_first_turns_replica": all(t["replica"] == c[0]["replica"] for c in conversations for t in c),
        "replicas_used": sorted({c[0]["replica"] for c in conversations}),
        "prefix_hit_rate_from_second_turn": round(hit_rate, 4),
        "min_turn_hit_rate_from_second_turn": round(min(t["cached_tokens"] / t["input_tokens"] for t in later), 4),
        "conversations_detail": conversations,
    }
    path = write_result("responses_turns", result, args.out)
    print(f"every turn answered: {result['every_turn_answered']}; prefix hit rate from the second turn: "
          f"{result['prefix_hit_rate_from_second_turn']} (lowest turn {result['min_turn_hit_rate_from_second_turn']}); "
          f"replicas used: {result['replicas_used']}; wrote {path}")


if __name__ == "__main__":
    main()
