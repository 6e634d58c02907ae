"""The hybrid hit: one prefix length every group can resume from.

A KV hit without its recurrent state is garbage (LMCache reported ~40% garbled
outputs from exactly that), so the answer is the longest L such that every attention
group holds all blocks of [0, L) *and* every recurrent group holds a snapshot at L.
Each group can only shrink the candidate, so repeating until nothing changes
converges; full attention goes first because it is the tightest cheap bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.core.groups.base import GroupManager
from hybridkv.core.hashing import BlockHash


def longest_hybrid_hit(
    groups: Sequence[GroupManager], hashes: Sequence[BlockHash], max_tokens: int
) -> int:
    """Largest length every group accepts, <= max_tokens. Read-only."""
    length = max_tokens
    while True:
        settled = length
        for group in groups:
            length = group.longest_hit(hashes, length)
            if length == 0:
                return 0
        if length == settled:
            return length
