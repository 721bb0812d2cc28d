"""`vllm-router`'s cache_aware policy (after SGLang's router), as the simulated fleet's baseline
(bench.w3_sim): facts from its documentation and --help, not its code.

Per worker, an approximate prefix tree of the prompts the router sent there (no KV events: its
own history), and the router's in-flight count per worker. For each request:
- if the load is imbalanced, ``max - min > balance_abs`` and ``max > balance_rel * min``, the least
  loaded worker;
- else, if the longest match over the trees covers more than ``cache_threshold`` of the prompt,
  the worker holding it (among equals, the least loaded);
- else the worker whose tree is smallest (the least cache used).
The prompt then joins the chosen worker's tree. Trees are pruned by size every
eviction interval (120 s); at these sizes they never reach the budget, so nothing is pruned.
Here the tree is over block hashes (16 tokens) where the real one is over characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# vllm-router 0.1.17's defaults (vllm-router --help).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


@dataclass
class CacheAware:
    block_size: int = 16
    cache_threshold: float = CACHE_THRESHOLD
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    trees: dict[int, set[int]] = field(default_factory=dict)  # worker -> block hashes sent there

    def choose(self, hashes: Sequence[int], prompt_tokens: int, loads: dict[int, int]) -> tuple[int, int]:
        """(worker, matched blocks) for a prompt of ``hashes`` given each worker's in-flight count."""
        workers = sorted(loads)
        for w in workers:
            self.trees.setdefault(w, set())
        high, low = max(loads.values()), min(loads.values())
        matched = {w: self._match(self.trees[w], hashes) for w in workers}
        if high - low > self.balance_abs and high > self.balance_rel * low:
            chosen = min(workers, key=lambda w: (loads[w], w))
        else:
            best = max(matched.values())
            if prompt_tokens and best * self.block_size / prompt_tokens > self.cache_threshold:
                chosen = min((w for w in workers if matched[w] == best), key=lambda w: (loads[w], w))
            else:
                chosen = min(workers, key=lambda w: (len(self.trees[w]), w))
        self.trees[chosen].update(hashes)
        return chosen, matched[chosen]

    @staticmethod
    def _match(tree: set[int], hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n
