"""What encoding long prompts in cached pieces (kvscale/token_pieces.py) saves, per request.

The bundled tokenizer, in process, each request's text encoded both ways in alternating order:
whole, as the ``tokenizers`` library does it (``encode_batch_fast``, what kvscale called before),
and by ``FastTokenizer.encode`` (pieces, cached); the ids must be equal. A fresh tokenizer, so an
empty cache, for each workload; the request streams are the routing grid's (bench.w3_grid_real),
in their order:

- ``w3-lite``, ``p256``, ``p1024``: the grid's text prompts, 12 groups of 512-, 256- or 1,024-token
  prefixes, 144 requests, random order;
- ``unique``: as ``w3-lite`` with a group per request: nothing is shared, every piece is new;
- ``w4-long-chat``: conversations about a 1,500-word document (bench.router_decision's
  ``w4-long``), each turn's rendered chat template, the text a server encodes.

Each workload runs ``--rounds`` times; the figures are those of the round with the median p50
speed-up, with every round's speed-ups beside them.

    python -m bench.token_pieces        # writes bench/results/token_pieces.json
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from bench import stats
from bench.common import REPO, git_commit, write_result
from bench.roofline import cpu_info
from bench.w3_grid_cells import W3_LITE
from bench.w3_grid_real import text_prompts
from bench.w3_workloads import WORDS, conversation_messages, conversations
from kvscale.fast_tokenizer import FastTokenizer
from kvscale.model_files import resolve_tokenizer_path
from kvscale.tokenization import render_chat_prompt


def grid_texts(prefix_tokens: int, seed: int, tokenizer: FastTokenizer) -> list[str]:
    return text_prompts(replace(W3_LITE, prefix_tokens=prefix_tokens), seed, tokenizer, opening="run")


def unique_texts(seed: int, tokenizer: FastTokenizer) -> list[str]:
    """As many prompts as W3-lite's, of its length, no two sharing more than a word or two."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(len(text.split()))) for text in grid_texts(512, seed, tokenizer)]


def chat_texts(seed: int, tokenizer: FastTokenizer) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for conv in conversations(seed, 24, 1500, 6, (0.0, 0.0)):
        answers: list[str] = []
        for turn in range(len(conv.questions)):
            texts.append(render_chat_prompt(tokenizer, conversation_messages(conv, turn, answers)))
            answers.append(" ".join(rng.choice(WORDS) for _ in range(40)))
    return texts


def compare(texts: list[str], tokenizer: FastTokenizer, add_special_tokens: bool) -> dict:
    """Each text both ways, alternating which goes first; milliseconds, and the speed-ups."""
    backend = tokenizer.backend_tokenizer
    samples: dict[str, list[float]] = {"whole": [], "pieces": []}
    for n, text in enumerate(texts):
        ids: dict[str, list[int]] = {}
        for way in (("whole", "pieces") if n % 2 == 0 else ("pieces", "whole")):
            started = time.perf_counter()
            if way == "whole":
                ids[way] = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids[way] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            samples[way].append((time.perf_counter() - started) * 1000)
        if ids["whole"] != ids["pieces"]:
            raise SystemExit(f"pieces and whole differ on request {n}: a bug in kvscale/token_pieces.py")
    whole_ms, pieces_ms = samples["whole"], samples["pieces"]
    whole, pieces = stats.summary(whole_ms), stats.summary(pieces_ms)
    assert tokenizer.pieces is not None
    return {
        "requests": len(texts),
        "chars_mean": sum(map(len, texts)) / len(texts),
        "whole_ms": whole, "pieces_ms": pieces,
        "speedup_p50": whole["p50"] / pieces["p50"], "speedup_p99": whole["p99"] / pieces["p99"],
        "speedup_mean": whole["mean"] / pieces["mean"],
        "piece_hits": tokenizer.pieces.hits, "piece_misses": tokenizer.pieces.misses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="passes over each workload, each on a fresh cache")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    path = resolve_tokenizer_path(None)

    def fresh() -> FastTokenizer:
        tokenizer = FastTokenizer.from_directory(path)
        if tokenizer is None or tokenizer.pieces is None:
            raise SystemExit("the bundled tokenizer is not cut into pieces: nothing to compare")
        return tokenizer

    machine = cpu_info()  # before the run: its load average is the start's
    maker = fresh()
    workloads = {
        "w3-lite": (grid_texts(512, args.seed, maker), True),
        "p256": (grid_texts(256, args.seed, maker), True),
        "p1024": (grid_texts(1024, args.seed, maker), True),
        "unique": (unique_texts(args.seed, maker), True),
        "w4-long-chat": (chat_texts(args.seed, maker), False),  # the template writes its special tokens
    }
    figures: dict[str, dict] = {}
    for name, (texts, add_special_tokens) in workloads.items():
        rounds = sorted((compare(texts, fresh(), add_special_tokens) for _ in range(args.rounds)),
                        key=lambda r: r["speedup_p50"])
        figures[name] = {**rounds[len(rounds) // 2],  # the round of the median p50 speed-up
                         "speedup_p50_by_round": [r["speedup_p50"] for r in rounds],
                         "speedup_p99_by_round": [r["speedup_p99"] for r in rounds]}
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in figures[name].items()
                     if k.startswith(("speedup", "requests", "piece"))})
    result = {"benchmark": "token_pieces", "command": "python -m bench.token_pieces", "machine": machine, "commit": git_commit(REPO),
              "parameters": vars(args), "workloads": figures}
    out = write_result("token_pieces", result, args.out)
    print(f"token_pieces: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
