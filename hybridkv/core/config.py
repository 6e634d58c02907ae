"""CacheConfig: how the cache is sized and what it keeps (one object every group reads)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """How the cache is sized and what it keeps."""

    memory_bytes: int
    block_tokens: int = 16
    enable_prefix_caching: bool = True
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    eviction: EvictionPolicy = EvictionPolicy.LRU
    eviction_alpha: float = 1.0
    cache_salt: str = ""  # anything else that changes what a cached page means
    # None: memory flows between groups. A fraction: recurrent groups are pinned to that
    # share of the chunks and attention to the rest (emulates SGLang's static split).
    state_memory_fraction: float | None = None
