"""The router benchmarks' workloads, shared by the real run (bench.w3_router) and the calibrated
simulator (bench.w3_policy_sim), so both see the same request streams for the same seed.

- W3: G groups, each a random P-token prefix; requests pick groups uniformly (random interleaving),
  each its group's prefix plus a unique S-token suffix.
- W3-Zipf: the same, but group popularity is Zipf-distributed (s = 1.1): a few prefixes are hot.
- W4: multi-turn chat. Conversations of 3-6 turns; turn 1 is a D-token document plus a question,
  each later turn's prompt is the whole history (previous prompt + answer) plus a new U-token
  message; the user thinks between turns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("w3", "w3-zipf", "w4")
ZIPF_S = 1.1
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue amber violet").split()


def _token(rng: random.Random) -> int:
    return rng.randrange(1000, 40000)


BURST = 6  # bursty arrivals: a group's requests come in runs of this many


def group_order(rng: random.Random, groups: int, requests: int, zipf: bool, bursty: bool = False) -> list[int]:
    if bursty:
        # Every group gets requests // groups, in runs of BURST back to back, the runs shuffled.
        runs = [[g] * BURST for g in range(groups) for _ in range(max(requests // groups // BURST, 1))]
        rng.shuffle(runs)
        order = [g for run in runs for g in run][:requests]
        return order + [i % groups for i in range(requests - len(order))]
    if not zipf:
        order = [i % groups for i in range(requests)]
        rng.shuffle(order)
        return order
    weights = [1.0 / (k + 1) ** ZIPF_S for k in range(groups)]
    return rng.choices(range(groups), weights=weights, k=requests)


def shared_prefix_prompts(
    seed: int, groups: int, prefix_tokens: int, requests: int, suffix_tokens: int, zipf: bool = False
) -> list[tuple[int, list[int]]]:
    """(group, token-id prompt) per request, in arrival order."""
    rng = random.Random(seed)
    prefixes = [[_token(rng) for _ in range(prefix_tokens)] for _ in range(groups)]
    order = group_order(rng, groups, requests, zipf)
    return [(g, prefixes[g] + [_token(rng) for _ in range(suffix_tokens)]) for g in order]


@dataclass
class Conversation:
    document_words: list[str]  # turn 1's document (text for the real run)
    questions: list[str]  # one user message per turn
    think_s: list[float]  # pause before each turn after the first


def conversations(seed: int, count: int, document_words: int, question_words: int,
                  think_s: tuple[float, float], turns: tuple[int, int] = (3, 6)) -> list[Conversation]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(*turns)
        doc = [rng.choice(WORDS) for _ in range(document_words)]
        qs = [" ".join(rng.choice(WORDS) for _ in range(question_words)) + "?" for _ in range(n)]
        out.append(Conversation(doc, qs, [0.0] + [rng.uniform(*think_s) for _ in range(n - 1)]))
    return out


def conversation_messages(conv: Conversation, turn: int, answers: list[str]) -> list[dict]:
    """The chat messages of ``turn`` (0-based): the history with its answers, then the new question."""
    messages = []
    for t in range(turn + 1):
        content = conv.questions[t]
        if t == 0:
            content = "Read this: " + " ".join(conv.document_words) + "\n" + content
        messages.append({"role": "user", "content": content})
        if t < turn:
            messages.append({"role": "assistant", "content": answers[t]})
    return messages


@dataclass
class Workload:
    """Closed-loop clients: each client runs its list of requests in order, pausing think_s before each."""

    clients: list[list[tuple[float, list[int], list[int], int]]]  # (think_s, prompt ids, answer ids, out tokens)


def build_workload(kind: str, p: dict, seed: int, tokenizer=None, answer_tokens: int | None = None) -> Workload:
    """A stream of these as simulated clients (``p``: the real run's parameters)."""
    if kind in ("w3", "w3-zipf"):
        prompts = [q for _, q in shared_prefix_prompts(seed, p["groups"], p["prefix_tokens"], p["requests"],
                                                         p["suffix_tokens"], zipf=kind == "w3-zipf")]
        clients: list[list] = [[] for _ in range(p["concurrency"])]
        # A closed loop of C clients taking the next prompt when free behaves like C fixed clients
        # taking every C-th prompt when service times are alike; good enough for a queueing model.
        for i, prompt in enumerate(prompts):
            clients[i % p["concurrency"]].append((0.0, prompt, [], p["output_tokens"]))
        return Workload(clients)
    from kvscale.tokenization import chat_prompt_token_ids

    n_answer = answer_tokens or p["answer_tokens"]
    rng = random.Random(seed + 7)
    convs = conversations(seed, p["conversations"], p["document_words"], p["question_words"],
                             (p["think_min_s"], p["think_max_s"]))
    clients = [[] for _ in range(p["concurrency"])]
    for i, conv in enumerate(convs):
        answers: list[str] = []
        turns = []
        for turn in range(len(conv.questions)):
            prompt = chat_prompt_token_ids(tokenizer, conversation_messages(conv, turn, answers))
            answer_text = " ".join(rng.choice(WORDS) for _ in range(n_answer))
            answer_ids = tokenizer.encode(answer_text, add_special_tokens=False)[:n_answer]
            turns.append((conv.think_s[turn], prompt, answer_ids, n_answer))
            answers.append(tokenizer.decode(answer_ids))
        clients[i % p["concurrency"]].extend(turns)
    return Workload(clients)
