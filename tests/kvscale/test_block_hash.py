"""The chained block hash shared by the engine and the router."""

from __future__ import annotations

import subprocess
import sys

from kvscale.block_hash import hash_block_tokens, hash_prompt_blocks


def test_only_full_blocks_are_hashed():
    assert hash_prompt_blocks(list(range(15)), 16) == []
    assert len(hash_prompt_blocks(list(range(16)), 16)) == 1
    assert len(hash_prompt_blocks(list(range(47)), 16)) == 2


def test_chain_depends_on_every_earlier_token():
    base = list(range(64))
    changed = list(base)
    changed[3] = 999
    a, b = hash_prompt_blocks(base, 16), hash_prompt_blocks(changed, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    # Same tokens later, same prefix: equal hashes up to the change.
    later = base[:32] + [5] * 32
    assert hash_prompt_blocks(later, 16)[:2] == a[:2]
    assert hash_prompt_blocks(later, 16)[2] != a[2]


def test_chain_matches_block_by_block():
    tokens = list(range(40))
    h0 = hash_block_tokens(None, tokens[:16])
    h1 = hash_block_tokens(h0, tokens[16:32])
    assert hash_prompt_blocks(tokens, 16) == [h0, h1]


def test_cache_salt_separates_caches():
    tokens = list(range(32))
    plain = hash_prompt_blocks(tokens, 16)
    salted = hash_prompt_blocks(tokens, 16, cache_salt="tenant-a")
    other = hash_prompt_blocks(tokens, 16, cache_salt="tenant-b")
    assert plain[0] != salted[0] != other[0]
    assert salted[1] != plain[1]  # the salt flows down the chain
    assert hash_prompt_blocks(tokens, 16, cache_salt="tenant-a") == salted


def test_hash_is_stable_across_processes():
    """A content hash, not Python's randomized hash(): another process agrees."""
    code = "from kvscale.block_hash import hash_prompt_blocks as h; print(h(list(range(48)), 16, 's'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == str(hash_prompt_blocks(list(range(48)), 16, "s"))


def test_known_leading_hashes_continue_the_chain_as_if_computed_here() -> None:
    tokens = list(range(100))
    for salt in (None, "tenant-a"):
        whole = hash_prompt_blocks(tokens, 16, cache_salt=salt)
        for known in range(len(whole) + 1):
            assert hash_prompt_blocks(tokens, 16, cache_salt=salt, known=whole[:known]) == whole
