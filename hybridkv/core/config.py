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
    # False: every snapshot due inside a chunk is taken during its forward (the runner
    # asks the recurrent ops for the state after that row). True: prefill chunks are cut
    # at each snapshot position and the state is copied after the forward, one step more
    # per snapshot (the engine before in-forward captures; the `hybridkv-prompt-end` design)
    split_prefill_at_snapshots: bool = False
    # None: memory flows between groups. A fraction: recurrent groups are pinned to that
    # share of the chunks and attention to the rest (emulates SGLang's static split).
    state_memory_fraction: float | None = None
    # While the scheduler expects to admit waiting requests (CacheManager.expect_admissions),
    # a token group that needs a page evicts one of its own cached pages rather than take
    # a chunk their live states will need (PageAllocator.reserve): KV pages of running
    # requests end up in most chunks, and a state page needs a whole unreferenced one, so a
    # chunk KV takes rarely comes back. False: the core before (and vLLM's emulations).
    reserve_live_states: bool = True
