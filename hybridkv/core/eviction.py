"""Which cached memory to give up when a group needs a page and nothing is free.

Candidates are of two shapes: a cached page of the group that needs memory (evicting it
yields that page), or a whole reclaimable chunk of another group (every page in it is
unreferenced; evicting its cached pages frees the chunk for any group).

- ``lru``: evict the least recently used candidate.
- ``cost``: Marconi's utility (MLSys'25, §4.3): ``recency + alpha * efficiency``, both
  min-max normalised over the candidates, evict the lowest. Efficiency is the prefix
  tokens a hit saves per byte held: a snapshot at position L saves L tokens for one
  state page; an attention block saves its block. Candidates are a window of the
  oldest pages per group, so each decision costs O(window), not O(cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class EvictionPolicy(Enum):
    LRU = "lru"
    COST = "cost"


@dataclass(frozen=True, slots=True)
class Candidate:
    """Something that can be evicted. ``page`` is set for a page, ``chunk`` for a chunk."""

    group_id: int
    last_used: int
    saved_tokens: int
    num_bytes: int
    page: int | None = None
    chunk: int | None = None


def _normalised(values: list[float]) -> list[float]:
    low, high = min(values), max(values)
    if high == low:
        return [0.0] * len(values)
    return [(v - low) / (high - low) for v in values]


def pick_victim(
    candidates: list[Candidate], policy: EvictionPolicy, alpha: float = 1.0
) -> Candidate | None:
    """The candidate to evict under ``policy``; None if there is none."""
    if not candidates:
        return None
    if policy is EvictionPolicy.LRU:
        return min(candidates, key=lambda c: c.last_used)
    recency = _normalised([float(c.last_used) for c in candidates])
    efficiency = _normalised([c.saved_tokens / c.num_bytes for c in candidates])
    utility = [r + alpha * e for r, e in zip(recency, efficiency, strict=True)]
    best = min(range(len(candidates)), key=lambda i: (utility[i], candidates[i].last_used))
    return candidates[best]
