"""Chained block hashes: each hash fingerprints the whole prefix up to its block's end.

``hash(block i) = H(hash(block i-1) || tokens of block i || extra)``, with a root that
names the model, its dtypes and anything else that changes what a cached page means
(adapter, cache salt). Hashes are bytes so the maps that hold them never box tuples.
xxh3-128 when the xxhash package is there, blake2b-128 otherwise: both are far beyond
collision reach for any cache size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

try:
    import xxhash

    def _digest(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data)

except ImportError:  # pragma: no cover - xxhash is a declared dependency

    def _digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()


def root_hash(*parts: str) -> BlockHash:
    """The parent of the first block: what must match for two caches to be shared."""
    return BlockHash(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    return BlockHash(_digest(parent + array("q", token_ids).tobytes() + extra))


def extend_block_hashes(
    hashes: list[BlockHash], root: BlockHash, token_ids: Sequence[int], block_tokens: int
) -> None:
    """Append the hashes of every block of ``token_ids`` that is full and not yet hashed.

    Incremental: a running request pays only for blocks that filled since the last call.
    """
    num_full = len(token_ids) // block_tokens
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_tokens : (i + 1) * block_tokens])
        hashes.append(parent)
