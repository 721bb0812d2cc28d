"""Identity of a full KV block: a hash chained over its parent's hash and its token ids.

This is the one implementation shared by the engine (prefix caching, KV events) and the
router (prefix-affinity lookup); both sides must agree to the bit, so the hash is a
content hash (sha256 over a fixed byte layout), never Python's per-process ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Seed for the first block's parent: a fixed constant, so every process agrees.
ROOT_PARENT_HASH: int = int.from_bytes(hashlib.sha256(b"kvscale-block-hash-v1").digest()[:8], "little")

_U64 = struct.Struct("<Q")


def hash_block_tokens(
    parent_hash: int | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int] = (),
) -> int:
    """Hash one full block given its parent's hash (None for the first block).

    ``extra_keys`` separates caches that must not share blocks even for equal tokens
    (e.g. a per-request ``cache_salt``); it is mixed into the block's hash and so,
    through the chain, into every later block.
    """
    digest = hashlib.sha256()
    digest.update(_U64.pack(ROOT_PARENT_HASH if parent_hash is None else parent_hash))
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = str(key).encode()
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return int.from_bytes(digest.digest()[:8], "little")


def first_block_keys(cache_salt: str | None, lora_name: str | None = None) -> tuple[str, ...]:
    """The extra keys of a sequence's first block: its cache salt and its LoRA adapter's name,
    each where there is one (the chain carries them to every later block). A prompt under two
    adapters, or under one and the base model, never shares a block."""
    keys: tuple[str, ...] = (cache_salt,) if cache_salt else ()
    return keys + ("lora:" + lora_name,) if lora_name else keys


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    known: Sequence[int] = (),
    lora_name: str | None = None,
) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block has none).

    The cache salt and the LoRA adapter's name are extra keys of the first block only
    (``first_block_keys``): the chain carries them onward.
    ``known`` holds the hashes of the leading full blocks when the caller already computed them
    for these same tokens, block size and salt (the router's previous turn of a conversation);
    the chain continues after them.
    """
    hashes: list[int] = list(known)
    parent: int | None = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        extra = first_block_keys(cache_salt, lora_name) if start == 0 else ()
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
