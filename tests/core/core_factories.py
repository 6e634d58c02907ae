"""Factories for the memory-core tests: tiny specs, exact arena layouts, managers, drivers.

Named ``core_factories`` (not ``factories``) so it never shadows ``tests/factories.py``:
pytest's default import mode puts every test directory on ``sys.path`` under the bare
module name, and the first ``factories`` imported would win for the whole session.

Sizes are chosen so that no page size divides another. With the defaults and
``block_tokens=4``::

    attention page   K + V: 2 x (4 tokens x 4 dims x 2 B)   =  64 B
    state page       conv (5, 3) bf16 = 30 B, aligned 32    \
                     + ssm (2, 5) fp32 = 40 B               =  80 B used, padded to 96 B
    chunk            192 B = 3 attention pages = 2 state pages

so attention chunk c holds pages 3c..3c+2 and state chunk c holds pages 2c and 2c+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.ids import PageId, ReqId
from hybridkv.core.layout import ArenaLayout, PageLayout, page_tensors
from hybridkv.core.manager import Allocation, CacheConfig, CacheManager, Hit
from hybridkv.core.spec import (
    AttentionSpec,
    LayerCache,
    ModelSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    Spec,
    StateKind,
    StateTensorSpec,
)

BLOCK = 4
CHUNK_BYTES = 192


def make_attention_spec(head_dim: int = 4, num_kv_heads: int = 1) -> AttentionSpec:
    return AttentionSpec(
        num_kv_heads=num_kv_heads, head_dim=head_dim, value_head_dim=head_dim, dtype="bfloat16"
    )


def make_sliding_spec(window_tokens: int, head_dim: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        num_kv_heads=1,
        head_dim=head_dim,
        value_head_dim=head_dim,
        dtype="bfloat16",
        window_tokens=window_tokens,
    )


def make_state_spec(
    conv: tuple[int, int] = (5, 3), ssm: tuple[int, ...] = (2, 5)
) -> RecurrentStateSpec:
    return RecurrentStateSpec(
        kind=StateKind.MAMBA2,
        tensors=(
            StateTensorSpec(name="conv", shape=conv, dtype="bfloat16"),
            StateTensorSpec(name="ssm", shape=ssm, dtype="float32"),
        ),
    )


def make_model(*specs: Spec, name: str = "tiny") -> ModelSpec:
    """One decoder layer per spec, in order (equal specs share a group)."""
    layers = tuple(
        LayerCache(
            layer_index=i,
            name="state" if isinstance(spec, RecurrentStateSpec) else "attn",
            spec=spec,
        )
        for i, spec in enumerate(specs)
    )
    return ModelSpec(
        name=name,
        model_type="tiny",
        num_layers=len(specs),
        dtype="bfloat16",
        max_model_len=None,
        layers=layers,
    )


def hybrid_model() -> ModelSpec:
    """Group 0: attention (64 B pages at block 4); group 1: state (80 B, padded to 96 B)."""
    return make_model(make_attention_spec(), make_state_spec())


def sliding_hybrid_model(window_tokens: int = 8) -> ModelSpec:
    """Groups: 0 full attention, 1 sliding window (both 64 B pages), 2 state."""
    return make_model(make_attention_spec(), make_sliding_spec(window_tokens), make_state_spec())


def attention_model() -> ModelSpec:
    return make_model(make_attention_spec())


def make_layout(
    model: ModelSpec,
    *,
    num_chunks: int,
    block_tokens: int = BLOCK,
    chunk_bytes: int = CHUNK_BYTES,
    tail_bytes: int = 0,
) -> ArenaLayout:
    """An arena of exactly ``num_chunks`` full chunks (+ a tail): small, exact page ids."""
    pages = []
    for group in model.groups:
        slots, used = page_tensors(group, block_tokens)
        page_bytes = used
        if group.is_recurrent:
            page_bytes = chunk_bytes // (chunk_bytes // used)
        assert chunk_bytes % page_bytes == 0, (chunk_bytes, page_bytes)
        pages.append(
            PageLayout(group_id=group.group_id, slots=slots, used_bytes=used, page_bytes=page_bytes)
        )
    return ArenaLayout(
        chunk_bytes=chunk_bytes,
        num_full_chunks=num_chunks,
        tail_bytes=tail_bytes,
        pages=tuple(pages),
        tail_group_ids=frozenset(g.group_id for g in model.groups if not g.is_recurrent),
    )


def make_manager(
    model: ModelSpec | None = None,
    *,
    num_chunks: int = 4,
    tail_bytes: int = 0,
    block_tokens: int = BLOCK,
    caching: bool = True,
    checkpoint: CheckpointPolicy | None = None,
    eviction: EvictionPolicy = EvictionPolicy.LRU,
    split: bool = False,
    reserve: bool = True,
) -> CacheManager:
    """``split``: prefill chunks are cut at snapshots (``split_prefill_at_snapshots``);
    ``reserve``: ``CacheConfig.reserve_live_states``."""
    model = model or hybrid_model()
    layout = make_layout(
        model, num_chunks=num_chunks, block_tokens=block_tokens, tail_bytes=tail_bytes
    )
    config = CacheConfig(
        memory_bytes=layout.total_bytes,
        block_tokens=block_tokens,
        enable_prefix_caching=caching,
        checkpoint=checkpoint or CheckpointPolicy(),
        eviction=eviction,
        split_prefill_at_snapshots=split,
        reserve_live_states=reserve,
    )
    return CacheManager(model, config, layout=layout)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class PageCounts(NamedTuple):
    free: tuple[int, ...]
    cached: tuple[int, ...]
    used: tuple[int, ...]
    owned_chunks: tuple[int, ...]
    free_chunks: int


def page_counts(mgr: CacheManager) -> PageCounts:
    pools = mgr.allocator.pools
    return PageCounts(
        free=tuple(p.num_free_pages for p in pools),
        cached=tuple(p.num_cached_pages for p in pools),
        used=tuple(p.num_used_pages for p in pools),
        owned_chunks=tuple(p.num_owned_chunks for p in pools),
        free_chunks=mgr.allocator.arena.num_free_chunks,
    )


# ----------------------------------------------------------------------------- drivers


def step(
    mgr: CacheManager, req: str, num_new_tokens: int, sampled: Sequence[int] = ()
) -> Allocation | None:
    """One scheduler step of a request: allocate, (run), commit. None if it did not fit."""
    req_id = ReqId(req)
    computed = mgr.num_computed_tokens(req_id)
    hit = mgr.find_hit(req_id) if not started(mgr, req) else None
    alloc = mgr.allocate(req_id, num_new_tokens, hit)
    if alloc is None:
        return None
    computed = mgr.num_computed_tokens(req_id)
    mgr.commit(req_id, computed + num_new_tokens, sampled)
    mgr.check_integrity()
    return alloc


def started(mgr: CacheManager, req: str) -> bool:
    return mgr._reqs[ReqId(req)].started


def prefill(
    mgr: CacheManager, req: str, prompt_len: int, sampled: int = -1, chunk_tokens: int = 1 << 30
) -> list[Allocation]:
    """Run a request's whole prompt in chunks of ``chunk_tokens``, also cut where
    ``next_split`` says (only a manager that splits prefills at snapshots cuts them).

    The first allocation takes the hit. The last chunk appends ``sampled`` (the first
    generated token). Fails the test if memory runs out.
    """
    req_id = ReqId(req)
    allocs: list[Allocation] = []
    hit: Hit | None = mgr.find_hit(req_id)
    while True:
        start = mgr.num_computed_tokens(req_id) if allocs else hit.num_tokens
        end = mgr.next_split(req_id, start, min(prompt_len, start + chunk_tokens))
        alloc = mgr.allocate(req_id, end - start, hit if not allocs else None)
        assert alloc is not None, f"{req}: prefill chunk [{start}, {end}) did not fit"
        allocs.append(alloc)
        done = end == prompt_len
        mgr.commit(req_id, end, [sampled] if done else [])
        mgr.check_integrity()
        if done:
            return allocs


def decode(mgr: CacheManager, req: str, sampled: Sequence[int]) -> list[Allocation]:
    """One decode step per sampled token (each step computes the previous token)."""
    allocs = []
    for token in sampled:
        alloc = step(mgr, req, 1, [token])
        assert alloc is not None, f"{req}: decode did not fit"
        allocs.append(alloc)
    return allocs


def snapshot_positions(mgr: CacheManager, req: str) -> list[int]:
    """Positions at which the request holds a snapshot, in every recurrent group."""
    per_group = [sorted(g.reqs[ReqId(req)].snapshots) for g in mgr.recurrent]
    assert all(p == per_group[0] for p in per_group)
    return per_group[0]


def parked(mgr: CacheManager, req: str) -> tuple[int, PageId] | None:
    """(position, page) of the request's newest snapshot, released while it runs
    (``CheckpointPolicy.release_newest``) and still cached; None if there is none."""
    group = mgr.recurrent[0]
    state = group.reqs[ReqId(req)]
    if state.parked is None or not group._is_parked(state):
        return None
    return state.parked.position, state.parked.page


def cached_snapshot_positions(mgr: CacheManager, token_ids: Sequence[int]) -> list[int]:
    """Block boundaries of ``token_ids`` with a cached snapshot in the first recurrent group."""
    from hybridkv.core.hashing import extend_block_hashes

    hashes: list = []
    extend_block_hashes(hashes, mgr._root, list(token_ids), mgr.block_tokens)
    pool = mgr.recurrent[0].pool
    return [(i + 1) * mgr.block_tokens for i, h in enumerate(hashes) if pool.lookup(h) is not None]
