"""Suffix decoding's cache of earlier responses: a suffix trie, cut at ``max_depth`` tokens, over
the outputs of the requests that finished last, each node counting the suffixes through it
(Arctic Inference's global suffix tree; vLLM's ``"method": "suffix"``).

Bounded three ways, so a long-running server's memory stays flat: at most ``max_responses``
responses (the oldest evicted first), at most ``max_nodes`` nodes (oldest evicted until under it),
and one response contributes at most ``max_nodes // max_depth`` tokens (its worst case fills
``max_depth`` nodes per token), so adding one never holds more than twice the budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ROOT = 0


@dataclass
class ResponseSuffixTree:
    max_depth: int
    max_responses: int
    max_nodes: int
    # Node i: its children by token, and how many inserted suffixes pass through it. Freed ids
    # are reused, so the lists never outgrow the largest tree held.
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    counts: list[int] = field(default_factory=lambda: [0])
    free_ids: list[int] = field(default_factory=list)
    responses: deque[tuple[int, ...]] = field(default_factory=deque)

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self.free_ids)

    def add(self, response: list[int]) -> None:
        """Cache one finished response (nothing when caching is off or it is empty)."""
        if self.max_responses == 0 or not response:
            return
        kept = tuple(response[:max(1, self.max_nodes // self.max_depth)])
        self._update(kept, +1)
        self.responses.append(kept)
        while self.responses and (len(self.responses) > self.max_responses or self.num_nodes - 1 > self.max_nodes):
            self._update(self.responses.popleft(), -1)

    def _update(self, tokens: tuple[int, ...], delta: int) -> None:
        """Insert (+1) or remove (-1) every suffix of ``tokens``, each cut at ``max_depth``."""
        children, counts = self.children, self.counts
        for start in range(len(tokens)):
            node = ROOT
            counts[ROOT] += delta
            for token in tokens[start:start + self.max_depth]:
                child = children[node].get(token)
                if child is None:  # only on insert: a removed suffix was inserted before
                    child = self._new_node()
                    children[node][token] = child
                counts[child] += delta
                if counts[child] == 0:  # no suffix passes it any more; neither through its subtree
                    del children[node][token]
                    self._drop_subtree(child)
                    break
                node = child

    def _new_node(self) -> int:
        if self.free_ids:
            node = self.free_ids.pop()
            self.children[node], self.counts[node] = {}, 0
            return node
        self.children.append({})
        self.counts.append(0)
        return len(self.counts) - 1

    def _drop_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(self.children[current].values())
            self.children[current] = {}
            self.free_ids.append(current)

    def match(self, pattern: list[int]) -> int | None:
        """The node ``pattern`` leads to from the root; None when no cached response holds it."""
        node = ROOT
        for token in pattern:
            next_node = self.children[node].get(token)
            if next_node is None:
                return None
            node = next_node
        return node

    def continuation(self, node: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """From ``node``, the most frequent child again and again: the tokens, while the product of
        the steps' frequencies (child count ÷ parent count: the share of the cached suffixes that
        went on that way) stays at least ``min_token_prob``, and the score, the sum of those
        products (the expected number of tokens accepted). Ties: the child seen first."""
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        children, counts = self.children, self.counts
        while len(tokens) < max_tokens and children[node]:
            token, child = max(children[node].items(), key=lambda item: counts[item[1]])
            prob *= counts[child] / counts[node]
            if prob < min_token_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score
