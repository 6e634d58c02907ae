"""The cache designs the simulator compares, each a configuration of the same core.

Only hybridkv is the real thing; the others are emulations of other systems' memory
designs, built from the core's options so that every design runs the same scheduler,
the same hashing and the same trace (docs/simulator.md says what each one leaves out)::

    hybridkv                natural page sizes (block 16), shared arena where chunks flow
                            between states and KV, sparse snapshots taken inside the
                            forward (branch points, prompt end, every ~4096 prompt
                            tokens, sequence end; a request
                            holds only its live state, its newest snapshot is parked in the
                            cache), LRU eviction with superseded snapshots demoted,
                            chunks kept for the live states of waiting requests (the
                            core's defaults)
    hybridkv-prompt-end     the policy before issue 12: no branch points nor prefill grid,
                            a request holds
                            its newest snapshot, and prefill chunks cut at the prompt-end
                            snapshot (one step more); no live-state reserve
    hybridkv-cost           hybridkv with cost-aware eviction (Marconi's utility)
    unified-page            vLLM's sizing: attention blocks inflated until one layer's KV
                            page is as big as one layer's state (planner.unified_baseline),
                            prefix blocks of that size and a snapshot at every block, all kept,
                            taken inside the forward (vLLM's "all" mamba cache mode), no
                            live-state reserve
    unified-page-retention  the same, keeping one snapshot per RETENTION_BLOCKS blocks
                            (plus the prompt end and the newest)
    static-split            SGLang's default pools: states get r/(1+r) of the memory with
                            r = 0.9, KV the rest, no flow; block 16, sparse snapshots, LRU
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.manager import CacheConfig
from hybridkv.core.planner import unified_baseline
from hybridkv.core.spec import ModelSpec

BLOCK_TOKENS = 16
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9  # --mamba-full-memory-ratio default
RETENTION_BLOCKS = 4  # unified-page-retention keeps a snapshot every 4 unified blocks


def unified_block_tokens(model: ModelSpec) -> int:
    """vLLM's inflated attention block for this model (16 when nothing needs inflating)."""
    return unified_baseline(model, 1 << 30, BLOCK_TOKENS, 1, 1).block_tokens


def _hybridkv(eviction: EvictionPolicy) -> Callable[[ModelSpec, int], CacheConfig]:
    def make(model: ModelSpec, memory_bytes: int) -> CacheConfig:
        return CacheConfig(memory_bytes=memory_bytes, block_tokens=BLOCK_TOKENS, eviction=eviction)

    return make


def _hybridkv_prompt_end(model: ModelSpec, memory_bytes: int) -> CacheConfig:
    return CacheConfig(
        memory_bytes=memory_bytes,
        block_tokens=BLOCK_TOKENS,
        checkpoint=CheckpointPolicy(
            at_branch_points=False, release_newest=False, prefill_grid_tokens=None
        ),
        split_prefill_at_snapshots=True,
        reserve_live_states=False,
    )


def _unified(retention_blocks: int | None) -> Callable[[ModelSpec, int], CacheConfig]:
    def make(model: ModelSpec, memory_bytes: int) -> CacheConfig:
        block = unified_block_tokens(model)
        policy = CheckpointPolicy(
            interval_tokens=block,
            retention_interval_tokens=block * retention_blocks if retention_blocks else None,
            at_branch_points=False,  # every block boundary is a checkpoint already
            prefill_grid_tokens=None,
            release_newest=False,  # a running vLLM request holds its blocks
        )
        return CacheConfig(
            memory_bytes=memory_bytes,
            block_tokens=block,
            checkpoint=policy,
            eviction=EvictionPolicy.LRU,
            reserve_live_states=False,  # vLLM's running requests take any free block
        )

    return make


def _static_split(model: ModelSpec, memory_bytes: int) -> CacheConfig:
    r = SGLANG_MAMBA_FULL_MEMORY_RATIO
    fraction = r / (1 + r) if model.num_recurrent_layers and model.num_attention_layers else None
    return CacheConfig(
        memory_bytes=memory_bytes,
        block_tokens=BLOCK_TOKENS,
        eviction=EvictionPolicy.LRU,
        state_memory_fraction=fraction,
    )


DESIGNS: dict[str, Callable[[ModelSpec, int], CacheConfig]] = {
    "hybridkv": _hybridkv(EvictionPolicy.LRU),
    "hybridkv-prompt-end": _hybridkv_prompt_end,
    "hybridkv-cost": _hybridkv(EvictionPolicy.COST),
    "unified-page": _unified(None),
    "unified-page-retention": _unified(RETENTION_BLOCKS),
    "static-split": _static_split,
}


def cache_config(design: str, model: ModelSpec, memory_bytes: int) -> CacheConfig:
    """The core configuration that emulates ``design`` for ``model`` in ``memory_bytes``.

    Raises:
        ValueError: an unknown design name.
    """
    make = DESIGNS.get(design)
    if make is None:
        raise ValueError(f"unknown design {design!r} (known: {', '.join(DESIGNS)})")
    return make(model, memory_bytes)
