"""The static chunk partition (default off) that emulates SGLang's fixed state/KV split."""

from __future__ import annotations

import pytest

from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.core.spec import (
    AttentionSpec,
    LayerCache,
    ModelSpec,
    RecurrentStateSpec,
    StateKind,
    StateTensorSpec,
)

BLOCK = 16


def make_model() -> ModelSpec:
    attn = AttentionSpec(num_kv_heads=1, head_dim=8, value_head_dim=8, dtype="bfloat16")
    state = RecurrentStateSpec(
        kind=StateKind.MAMBA2,
        tensors=(StateTensorSpec(name="ssm", shape=(BLOCK * 16,), dtype="float32"),),
    )
    return ModelSpec(
        name="tiny",
        model_type="tiny",
        num_layers=2,
        dtype="bfloat16",
        max_model_len=None,
        layers=(
            LayerCache(layer_index=0, name="attn", spec=attn),
            LayerCache(layer_index=1, name="state", spec=state),
        ),
    )


def make_manager(num_chunks: int, fraction: float | None) -> CacheManager:
    model = make_model()
    probe = CacheManager(model, CacheConfig(memory_bytes=1 << 20))
    chunk = probe.layout.chunk_bytes
    return CacheManager(
        model, CacheConfig(memory_bytes=num_chunks * chunk, state_memory_fraction=fraction)
    )


def test_state_groups_stay_in_their_chunks() -> None:
    mgr = make_manager(num_chunks=8, fraction=0.25)
    state_ppc = mgr.layout.pages_per_chunk(1)
    for i in range(2 * state_ppc + 1):  # one more live state than two chunks hold
        req = ReqId(f"r{i}")
        mgr.add_request(req, list(range(4)))
        alloc = mgr.allocate(req, 4, mgr.find_hit(req))
        mgr.check_integrity()
        if i < 2 * state_ppc:
            assert alloc is not None
            assert (
                mgr.allocator.arena.owner(mgr.allocator.pools[1].chunk_of(alloc.new_pages[1][0]))
                == 1
            )
        else:
            assert alloc is None  # free KV chunks exist, but the state pool is full
    assert mgr.allocator.arena.chunks_of(1) == [0, 1]
    assert mgr.allocator.arena.chunks_of(0)
    assert all(c >= 2 for c in mgr.allocator.arena.chunks_of(0))


def test_without_a_split_states_take_any_chunk() -> None:
    mgr = make_manager(num_chunks=8, fraction=None)
    state_ppc = mgr.layout.pages_per_chunk(1)
    for i in range(2 * state_ppc + 1):
        req = ReqId(f"r{i}")
        mgr.add_request(req, list(range(4)))
        assert mgr.allocate(req, 4, mgr.find_hit(req)) is not None
    mgr.check_integrity()
    assert len(mgr.allocator.arena.chunks_of(1)) == 3


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_split_fraction_must_be_a_proper_share(fraction: float) -> None:
    with pytest.raises(ValueError, match="state fraction"):
        make_manager(num_chunks=4, fraction=fraction)
