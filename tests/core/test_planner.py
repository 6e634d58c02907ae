"""The planner against the physical limit, for every built-in model at a few budgets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from core_factories import make_attention_spec, make_model, make_state_spec

from hybridkv.core.ids import ReqId
from hybridkv.core.layout import build_layout
from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.core.model_config import builtin_model_names, load_model_spec
from hybridkv.core.planner import (
    STATE_PAGES_PER_SEQ,
    UNBOUNDED_TOKENS,
    PlanError,
    max_seq_len,
    plan,
)

GIB = 1 << 30
BUDGETS = [(24, 32, 8192), (80, 256, 8192)]  # GiB, max_num_seqs, max_model_len


@pytest.mark.parametrize("name", builtin_model_names())
@pytest.mark.parametrize(
    ("gib", "seqs", "max_len"), BUDGETS, ids=[f"{g}gib-{s}seqs" for g, s, _ in BUDGETS]
)
def test_capacity_is_within_one_percent_of_the_physical_limit(
    name: str, gib: int, seqs: int, max_len: int
) -> None:
    spec = load_model_spec(name)
    memory = gib * GIB
    p = plan(spec, memory, max_num_seqs=seqs, max_model_len=max_len)
    assert p.padding_waste_bytes >= 0
    assert p.padding_waste_bytes < 0.01 * memory
    assert p.layout.total_bytes <= memory
    assert p.max_concurrency >= 1
    if spec.num_attention_layers == 0:
        assert p.kv_capacity_tokens is None and p.physical_limit_tokens is None
        return
    assert p.max_num_seqs <= seqs
    limit = (memory - p.max_num_seqs * spec.state_bytes_per_seq) // spec.kv_bytes_per_token
    assert p.physical_limit_tokens == limit
    assert p.kv_capacity_tokens is not None
    assert p.kv_capacity_tokens <= limit
    assert p.kv_capacity_tokens >= 0.99 * limit


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "llama-3.1-8b", "mamba2-2.7b"])
def test_concurrency_fits_the_memory(name: str) -> None:
    spec = load_model_spec(name)
    p = plan(spec, 24 * GIB, max_num_seqs=32, max_model_len=8192)
    need = p.max_concurrency * (spec.state_bytes_per_seq + 8192 * spec.kv_bytes_per_token)
    assert need <= 24 * GIB


def test_pure_attention_plan() -> None:
    spec = make_model(make_attention_spec(), make_attention_spec())
    p = plan(spec, 1 << 20, max_num_seqs=4, max_model_len=64)
    assert [g.kind for g in p.groups] == ["attention"]
    assert p.state_bytes_per_seq == 0
    assert p.physical_limit_tokens == (1 << 20) // spec.kv_bytes_per_token
    assert p.kv_capacity_tokens == p.physical_limit_tokens  # nothing to pad
    assert p.padding_waste_bytes == 0


def test_pure_mamba2_plan() -> None:
    spec = load_model_spec("mamba2-2.7b")
    p = plan(spec, 8 * GIB, max_num_seqs=16, max_model_len=4096)
    assert [g.kind for g in p.groups] == ["mamba2"]
    assert p.kv_capacity_tokens is None
    assert p.max_concurrency >= 8 * GIB // spec.state_bytes_per_seq * 0.99
    assert p.max_concurrency <= 8 * GIB // spec.state_bytes_per_seq


def test_tiny_hybrid_plan_groups() -> None:
    spec = make_model(make_attention_spec(), make_state_spec())
    p = plan(spec, 1 << 20, max_num_seqs=8, max_model_len=64, block_tokens=4)
    assert [(g.kind, g.block_tokens) for g in p.groups] == [("attention", 4), ("mamba2", None)]
    assert p.groups[1].used_bytes == 80
    assert p.layout.chunk_bytes % p.groups[0].page_bytes == 0
    assert p.layout.chunk_bytes % p.groups[1].page_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_bytes": -1}, "memory must be positive"),
        ({"memory_bytes": 0}, "memory must be positive"),
        ({"memory_bytes": 1 << 20}, "too small for one sequence"),
        ({"max_model_len": 10_000_000}, "max_model_len=10000000"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"block_tokens": 12}, "power of two"),
    ],
    ids=["negative", "zero", "tiny", "too-long", "no-seqs", "no-len", "block"],
)
def test_plan_errors(kwargs: dict[str, int], message: str) -> None:
    spec = load_model_spec("qwen3.5-0.8b")
    args: dict[str, int] = {"memory_bytes": 2 * GIB, **kwargs}
    memory = args.pop("memory_bytes")
    with pytest.raises(PlanError, match=message):
        plan(spec, memory, **args)


def test_too_many_sequences_are_clamped_with_a_warning() -> None:
    spec = load_model_spec("qwen3.5-0.8b")
    p = plan(spec, 1 * GIB, max_num_seqs=10_000, max_model_len=1024)
    assert p.max_num_seqs < 10_000
    assert any("clamped" in w for w in p.warnings)
    assert p.kv_capacity_tokens is not None and p.kv_capacity_tokens > 0


def test_core_does_not_import_torch() -> None:
    code = (
        "import sys, hybridkv.core, hybridkv.core.manager, hybridkv.core.planner, "
        "hybridkv.core.model_config, hybridkv.cli.plan; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


SEQ_LEN_CASES = [
    ("qwen3.5-0.8b", 1.0),
    ("granite-4.0-h-1b", 0.5),
    ("lfm2-350m", 0.3),
    ("ai21-jamba-1.5-mini", 2.0),
]


@pytest.mark.parametrize(("name", "gib"), SEQ_LEN_CASES, ids=[n for n, _ in SEQ_LEN_CASES])
def test_max_seq_len_is_what_the_allocator_serves(name: str, gib: float) -> None:
    """The engine's start-up rule counts tail-chunk pages: the allocator must really serve them.

    One sequence of ``max_seq_len`` tokens allocates while every recurrent group holds
    ``STATE_PAGES_PER_SEQ`` state pages (its live state included).
    """
    spec = load_model_spec(name)
    memory = int(gib * GIB)
    mgr = CacheManager(spec, CacheConfig(memory_bytes=memory, enable_prefix_caching=False))
    length = max_seq_len(mgr.layout, spec, mgr.block_tokens)
    assert 0 < length < UNBOUNDED_TOKENS
    assert mgr.layout.tail_bytes > 0  # the case the rule's tail term is for
    held = []  # the live page comes with the request's allocation
    for group in mgr.state_groups.values():
        for _ in range(STATE_PAGES_PER_SEQ - 1):
            page = mgr.allocator.allocate(group.group_id)
            assert page is not None
            held.append((group, page))
    mgr.add_request(ReqId("long"), list(range(length)))
    assert mgr.allocate(ReqId("long"), length) is not None
    for group, page in held:
        group.pool.release(page, mgr.allocator.clock)
    mgr.free(ReqId("long"))
    mgr.check_integrity()


def test_max_seq_len_of_a_model_without_attention_is_unbounded() -> None:
    spec = load_model_spec("mamba2-2.7b")
    layout = build_layout(spec.groups, 16, 1 * GIB)
    assert max_seq_len(layout, spec, 16) == UNBOUNDED_TOKENS


@pytest.mark.parametrize("name", builtin_model_names())
def test_concurrency_cap_names_the_resource_that_binds(name: str) -> None:
    """effective = min(joint, max_num_seqs); joint <= both bounds; binding names the minimum."""
    spec = load_model_spec(name)
    for seqs, max_len in ((1, 8192), (4, 8192), (4096, 8192), (4096, 512)):
        c = plan(spec, 8 * GIB, max_num_seqs=seqs, max_model_len=max_len).concurrency
        assert c.effective == min(c.joint, seqs) and c.max_num_seqs == seqs
        bounds = [b for b in (c.kv_bound, c.state_bound) if b is not None]
        assert bounds and c.joint <= min(bounds)
        if seqs <= c.joint:
            assert c.binding == "max_num_seqs"
        else:
            smaller = "kv_cache" if c.state_bound is None else "state"
            if c.kv_bound is not None and c.state_bound is not None:
                smaller = "kv_cache" if c.kv_bound <= c.state_bound else "state"
            assert c.binding == smaller
    one = plan(spec, 8 * GIB, max_num_seqs=1, max_model_len=8192).concurrency
    assert one.binding == "max_num_seqs" and one.effective == 1
