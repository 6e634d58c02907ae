"""EngineConfig: every engine option in one validated place (the CLI and server reuse it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.units import GIB

DEFAULT_CACHE_MEMORY_GIB = 2.0  # vLLM's CPU backend reserves 4 GiB; our test models are tiny
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = {"lru": EvictionPolicy.LRU, "cost": EvictionPolicy.COST}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine is built.

    Attributes:
        model: checkpoint directory (config.json, *.safetensors, tokenizer.json).
        max_model_len: prompt + output tokens of one sequence at most; None: the model's
            ``max_position_embeddings`` if the cache can hold one such sequence, else the
            most the cache holds (a warning says so).
        max_num_seqs: sequences running at once at most.
        max_num_batched_tokens: tokens in one step (prefill chunks + decodes) at most.
        cache_memory_gib: the arena for KV pages and state pages.
        block_size: tokens per attention page (and the grid of state snapshots).
        enable_prefix_caching: reuse KV pages and state snapshots across requests.
        dtype: model and cache dtype; "auto" is float32 on CPU, else the config's dtype.
        device: "cpu" or a torch device string such as "cuda".
        eviction: "lru" or "cost" (Marconi-style: tokens saved per byte, with recency).
        checkpoint_interval: also snapshot states every this many tokens (shared prefixes
            of other requests); None snapshots only prompt and sequence ends.
        retention_interval: superseded snapshots are kept only on multiples of this.
        seed: seeds the sampling of requests without a seed of their own.
        poison_cache: fill the arena with 0xFF bytes (NaN in every float dtype) at start,
            so a read of cache memory nobody wrote shows up as NaN logits (tests, debugging).
    """

    model: str
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    cache_memory_gib: float = DEFAULT_CACHE_MEMORY_GIB
    block_size: int = 16
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    eviction: str = "lru"
    eviction_alpha: float = 1.0
    checkpoint_interval: int | None = None
    retention_interval: int | None = None
    seed: int = 0
    poison_cache: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        positive_int("block_size", self.block_size)
        if not isinstance(self.cache_memory_gib, int | float) or not (
            math.isfinite(self.cache_memory_gib) and self.cache_memory_gib > 0
        ):
            raise ValueError(
                f"cache_memory_gib must be a positive number, got {self.cache_memory_gib!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction must be one of {sorted(EVICTION_POLICIES)}, got {self.eviction!r}"
            )
        self.checkpoint_policy.validate(self.block_size)

    @property
    def cache_memory_bytes(self) -> int:
        return int(self.cache_memory_gib * GIB)

    @property
    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(
            interval_tokens=self.checkpoint_interval,
            retention_interval_tokens=self.retention_interval,
        )

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return EVICTION_POLICIES[self.eviction]
