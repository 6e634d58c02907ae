"""Capacity from a model's specs and a memory budget, measured against the physical limit.

For a budget ``M``, ``S`` live sequences, ``s`` state bytes per sequence and ``a`` KV
bytes per token, no allocator can hold more than ``floor((M - S*s) / a)`` tokens of KV.
The plan reports what *this* arena holds against that limit, and what a single unified
page size (vLLM's sizing of hybrid caches) would hold in the same memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.spec import ModelSpec, RecurrentStateSpec

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_MODEL_LEN = 4096  # when the config names none
# State pages one running sequence may hold at once: its live state, the snapshot being
# written this step, and the snapshot it resumed from (held until its restore has run).
STATE_PAGES_PER_SEQ = 3
# State pages per sequence: one count for every recurrent group, or one per group id.
PagesPerSeq: TypeAlias = int | Mapping[int, int]
UNBOUNDED_TOKENS = 1 << 62  # a model without attention: length costs no memory


class PlanError(ValueError):
    """The request cannot be planned; the message says what to change."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlan:
    kind: str
    num_layers: int
    page_bytes: int  # padded stride in the arena
    used_bytes: int  # bytes the layers need
    block_tokens: int | None  # None for a state group: one page per sequence
    pages_per_chunk: int
    state_pages_per_seq: int | None = None  # a state group: live (+ scratch) per sequence
    draft: bool = False  # the speculative draft model's layers


@dataclass(frozen=True, kw_only=True, slots=True)
class UnifiedBaseline:
    """One page size for every layer, as vLLM sizes hybrid caches today."""

    block_tokens: int
    group_size: int
    num_attention_groups: int
    num_state_groups: int
    num_blocks: int
    kv_capacity_tokens: int | None
    max_concurrency: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Concurrency:
    """How many sequences of max_model_len run at once, and which resource says so.

    The KV-bound counts attention blocks as if states took no room, the state-bound counts
    live states as if KV took no room; in one shared arena both compete, so ``joint`` (both
    at once) is at most the smaller. The effective cap is ``min(joint, max_num_seqs)``;
    ``binding`` names what sets it: ``max_num_seqs``, ``kv_cache`` or ``state`` (the
    smaller of the two bounds). SGLang #38846: an operator benchmarked 9 concurrent
    requests believing in 32 because this cap was only in a log line.
    """

    kv_bound: int | None  # None: no attention layer, length costs no KV
    state_bound: int | None  # None: no recurrent layer (the state slots of the arena)
    joint: int
    max_num_seqs: int
    effective: int
    binding: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    memory_bytes: int
    block_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    layout: ArenaLayout
    groups: tuple[GroupPlan, ...]
    state_chunks: int
    kv_capacity_tokens: int | None
    physical_limit_tokens: int | None
    max_concurrency: int
    concurrency: Concurrency
    padding_waste_bytes: int
    unified: UnifiedBaseline
    warnings: list[str] = field(default_factory=list)
    num_speculative_tokens: int = 0
    # recurrent group id -> state pages one running sequence holds (live + scratch)
    state_pages_per_seq: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "memory_bytes": self.memory_bytes,
            "block_tokens": self.block_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_seq": self.state_bytes_per_seq,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "physical_limit_tokens": self.physical_limit_tokens,
            "max_concurrency": self.max_concurrency,
            "concurrency": {
                "kv_bound": self.concurrency.kv_bound,
                "state_bound": self.concurrency.state_bound,
                "joint": self.concurrency.joint,
                "max_num_seqs": self.concurrency.max_num_seqs,
                "effective": self.concurrency.effective,
                "binding": self.concurrency.binding,
            },
            "num_speculative_tokens": self.num_speculative_tokens,
            "padding_waste_bytes": self.padding_waste_bytes,
            "padding_waste_percent": round(100 * self.padding_waste_bytes / self.memory_bytes, 4),
            "chunk_bytes": self.layout.chunk_bytes,
            "num_chunks": self.layout.num_chunks,
            "state_chunks": self.state_chunks,
            "groups": [
                {
                    "kind": g.kind,
                    "num_layers": g.num_layers,
                    "page_bytes": g.page_bytes,
                    "used_bytes": g.used_bytes,
                    "block_tokens": g.block_tokens,
                    "pages_per_chunk": g.pages_per_chunk,
                    "state_pages_per_seq": g.state_pages_per_seq,
                    "draft": g.draft,
                }
                for g in self.groups
            ],
            "unified_page_baseline": {
                "block_tokens": self.unified.block_tokens,
                "group_size": self.unified.group_size,
                "num_blocks": self.unified.num_blocks,
                "kv_capacity_tokens": self.unified.kv_capacity_tokens,
                "max_concurrency": self.unified.max_concurrency,
            },
            "warnings": self.warnings,
        }


# ----------------------------------------------------------------------------- arena math


def state_pages_per_seq(
    spec: ModelSpec, num_speculative_tokens: int = 0, held: int = STATE_PAGES_PER_SEQ
) -> dict[int, int]:
    """State pages one running sequence may hold at once, per recurrent group.

    ``held`` pages of a target group (live + snapshots: 3 for the length check, 1 live
    state for concurrency), plus during a speculative step one scratch page per draft
    token (the state after each position the step may stop at); a draft model's group
    holds its live state and, while speculating, one working page (no snapshots).
    """
    k = num_speculative_tokens
    return {
        g.group_id: (1 + bool(k)) if g.is_draft else held + k for g in spec.groups if g.is_recurrent
    }


def _pages(pages_per_seq: PagesPerSeq, group_id: int) -> int:
    return pages_per_seq if isinstance(pages_per_seq, int) else pages_per_seq[group_id]


def _state_chunks(
    layout: ArenaLayout, spec: ModelSpec, num_seqs: int, pages_per_seq: PagesPerSeq = 1
) -> int:
    """Full chunks that the state pages of ``num_seqs`` sequences take in every recurrent
    group (``pages_per_seq`` each; one live state by default). Never the tail."""
    return sum(
        -(-num_seqs * _pages(pages_per_seq, g.group_id) // layout.pages_per_chunk(g.group_id))
        for g in spec.groups
        if g.is_recurrent
    )


def _max_kv_blocks(layout: ArenaLayout, spec: ModelSpec, free_full_chunks: int) -> int:
    """Blocks of every attention group that fit in ``free_full_chunks`` plus the tail."""
    token_groups = [g.group_id for g in spec.groups if not g.is_recurrent]
    if not token_groups or free_full_chunks < 0:
        return 0
    if len(token_groups) == 1:
        g = token_groups[0]
        return free_full_chunks * layout.pages_per_chunk(g) + layout.pages_in_chunk(
            g, layout.num_full_chunks
        ) * bool(layout.tail_bytes)

    def chunks_for(n: int) -> int:
        return sum(-(-n // layout.pages_per_chunk(g)) for g in token_groups)

    high = free_full_chunks * max(layout.pages_per_chunk(g) for g in token_groups)
    return _largest(lambda n: chunks_for(n) <= free_full_chunks, high)


def max_seq_len(
    layout: ArenaLayout,
    spec: ModelSpec,
    block_tokens: int,
    state_pages_per_seq: PagesPerSeq = STATE_PAGES_PER_SEQ,
) -> int:
    """Tokens of the longest single sequence the arena holds (the engine's start-up check).

    The same arithmetic as every other figure of the plan: ``state_pages_per_seq`` state
    pages per recurrent group (one count, or per group id: :func:`state_pages_per_seq`
    with speculation) take whole chunks, attention blocks fill the rest and the tail.
    """
    free = layout.num_full_chunks - _state_chunks(layout, spec, 1, state_pages_per_seq)
    if free < 0:
        return 0
    if not spec.num_attention_layers:
        return UNBOUNDED_TOKENS
    return _max_kv_blocks(layout, spec, free) * block_tokens


def _max_concurrency(
    layout: ArenaLayout,
    spec: ModelSpec,
    block_tokens: int,
    seq_len: int,
    pages_per_seq: PagesPerSeq = 1,
) -> int:
    blocks_per_seq = -(-seq_len // block_tokens) if spec.num_attention_layers else 0

    def fits(num_seqs: int) -> bool:
        free = layout.num_full_chunks - _state_chunks(layout, spec, num_seqs, pages_per_seq)
        return free >= 0 and _max_kv_blocks(layout, spec, free) >= num_seqs * blocks_per_seq

    high = max(1, layout.total_bytes // max(1, spec.state_bytes_per_seq or 1))
    return _largest(fits, min(high, 1 << 24))


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest n in [0, high] with ``fits(n)``, for a ``fits`` that holds up to some n
    and fails beyond it (every count the plan searches for is monotone that way)."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _state_bound(
    layout: ArenaLayout, spec: ModelSpec, pages_per_seq: PagesPerSeq = 1
) -> int | None:
    """Sequences whose states (live, and scratch when speculating) the arena holds when
    KV takes no room (None: no recurrent group)."""
    if not any(g.is_recurrent for g in spec.groups):
        return None

    def fits(num_seqs: int) -> bool:
        return _state_chunks(layout, spec, num_seqs, pages_per_seq) <= layout.num_full_chunks

    high = 1
    while fits(high):
        high *= 2
    return _largest(fits, high)


def concurrency(
    layout: ArenaLayout,
    spec: ModelSpec,
    block_tokens: int,
    seq_len: int,
    max_num_seqs: int,
    pages_per_seq: PagesPerSeq = 1,
) -> Concurrency:
    """The bounds on sequences of ``seq_len`` running at once; see :class:`Concurrency`.
    ``pages_per_seq``: state pages of each (:func:`state_pages_per_seq`; 1: a live state)."""
    kv_bound = None
    if spec.num_attention_layers:
        blocks_per_seq = -(-seq_len // block_tokens)
        kv_bound = _max_kv_blocks(layout, spec, layout.num_full_chunks) // blocks_per_seq
    state_bound = _state_bound(layout, spec, pages_per_seq)
    joint = _max_concurrency(layout, spec, block_tokens, seq_len, pages_per_seq)
    if max_num_seqs <= joint:
        binding = "max_num_seqs"
    elif state_bound is None or (kv_bound is not None and kv_bound <= state_bound):
        binding = "kv_cache"
    else:
        binding = "state"
    return Concurrency(
        kv_bound=kv_bound,
        state_bound=state_bound,
        joint=joint,
        max_num_seqs=max_num_seqs,
        effective=min(joint, max_num_seqs),
        binding=binding,
    )


# ----------------------------------------------------------------------------- baseline


def unified_baseline(
    spec: ModelSpec,
    memory_bytes: int,
    block_tokens: int,
    num_seqs: int,
    seq_len: int,
    num_speculative_tokens: int = 0,
) -> UnifiedBaseline:
    """vLLM's hybrid sizing: attention blocks inflated until one layer's page holds a state.

    Layers are split into groups of ``group_size`` (the smallest layer count per kind,
    or the largest when it is under 1.5x the smallest); a block is one page per layer of
    a group; every state group costs one block per sequence (prefix caching off).
    """
    attn = [layer.spec for layer in spec.layers if not isinstance(layer.spec, RecurrentStateSpec)]
    state = [layer.spec for layer in spec.layers if isinstance(layer.spec, RecurrentStateSpec)]
    per_token = attn[0].bytes_per_token if attn else 0
    state_page = max((s.bytes_per_seq for s in state), default=0)
    unified_block = block_tokens
    if attn and state:
        unified_block = max(block_tokens, 16 * -(-state_page // (16 * per_token)))
    page = max(unified_block * per_token, state_page)
    counts = [c for c in (len(attn), len(state)) if c]
    group_size = min(counts)
    if max(counts) < 1.5 * group_size:
        group_size = max(counts)
    attn_groups = -(-len(attn) // group_size) if attn else 0
    state_groups = -(-len(state) // group_size) if state else 0
    num_blocks = max(0, memory_bytes // (group_size * page) - 1)  # block 0 is the null block
    # with speculation vLLM gives each state group 1 + num_speculative_blocks per sequence
    state_blocks = state_groups * (1 + num_speculative_tokens)
    kv_tokens = None
    if attn_groups:
        left = max(0, num_blocks - num_seqs * state_blocks)
        kv_tokens = left // attn_groups * unified_block
    per_seq = attn_groups * -(-seq_len // unified_block) + state_blocks
    return UnifiedBaseline(
        block_tokens=unified_block,
        group_size=group_size,
        num_attention_groups=attn_groups,
        num_state_groups=state_groups,
        num_blocks=num_blocks,
        kv_capacity_tokens=kv_tokens,
        max_concurrency=num_blocks // per_seq if per_seq else 0,
    )


# ----------------------------------------------------------------------------- plan


def plan(
    spec: ModelSpec,
    memory_bytes: int,
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    block_tokens: int = 16,
    num_speculative_tokens: int = 0,
) -> Plan:
    """Lay out the arena and measure it.

    With ``num_speculative_tokens`` every running sequence counts its scratch states
    (:func:`state_pages_per_seq`) beside its live state.

    Raises:
        PlanError: non-positive sizes, or memory too small for one sequence.
    """
    _validate(memory_bytes, max_num_seqs, max_model_len, block_tokens)
    if num_speculative_tokens < 0:
        raise PlanError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    seq_len = max_model_len or spec.max_model_len or DEFAULT_MAX_MODEL_LEN
    try:
        layout = build_layout(spec.groups, block_tokens, memory_bytes)
    except ValueError as exc:
        raise PlanError(f"budget too small for one sequence: {exc}") from None
    a, s = spec.kv_bytes_per_token, spec.state_bytes_per_seq
    warnings: list[str] = []
    one_seq = s + block_tokens * a
    per_seq = state_pages_per_seq(spec, num_speculative_tokens, held=1)
    fit = _max_seqs_with_one_block(layout, spec, per_seq)
    if fit == 0:
        raise PlanError(
            f"budget too small for one sequence: {memory_bytes} B cannot hold a state "
            f"({s} B) and one block of KV ({block_tokens * a} B) in chunks of "
            f"{layout.chunk_bytes} B"
        )
    num_seqs = requested_seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
    if num_seqs > fit:
        warnings.append(
            f"max_num_seqs {num_seqs} clamped to {fit}: more live states than that leave no "
            f"KV room ({one_seq} B per sequence)"
        )
        num_seqs = fit
    if _max_concurrency(layout, spec, block_tokens, seq_len, per_seq) == 0:
        raise PlanError(
            f"budget too small for one sequence of max_model_len={seq_len} tokens: "
            f"lower --max-model-len or raise --memory-gib"
        )
    bounds = concurrency(layout, spec, block_tokens, seq_len, requested_seqs, per_seq)
    return _measure(
        spec, layout, memory_bytes, block_tokens, num_seqs, seq_len, bounds, warnings,
        num_speculative_tokens,
    )  # fmt: skip


def _max_seqs_with_one_block(
    layout: ArenaLayout, spec: ModelSpec, pages_per_seq: PagesPerSeq = 1
) -> int:

    def fits(num_seqs: int) -> bool:
        free = layout.num_full_chunks - _state_chunks(layout, spec, num_seqs, pages_per_seq)
        return free >= 0 and (
            not spec.num_attention_layers or _max_kv_blocks(layout, spec, free) >= num_seqs
        )

    return _largest(fits, 1 << 20)


def _measure(
    spec: ModelSpec,
    layout: ArenaLayout,
    memory_bytes: int,
    block_tokens: int,
    num_seqs: int,
    seq_len: int,
    bounds: Concurrency,
    warnings: list[str],
    num_speculative_tokens: int = 0,
) -> Plan:
    a, s = spec.kv_bytes_per_token, spec.state_bytes_per_seq
    per_seq = state_pages_per_seq(spec, num_speculative_tokens, held=1)
    state_chunks = _state_chunks(layout, spec, num_seqs, per_seq)
    state_bytes = sum(  # live (and scratch) states of one sequence: s without speculation
        g.page_bytes(block_tokens) * per_seq[g.group_id] for g in spec.groups if g.is_recurrent
    )
    kv_blocks = _max_kv_blocks(layout, spec, layout.num_full_chunks - state_chunks)
    groups = tuple(
        GroupPlan(
            kind=g.spec.label,
            num_layers=g.num_layers,
            page_bytes=layout.pages[g.group_id].page_bytes,
            used_bytes=layout.pages[g.group_id].used_bytes,
            block_tokens=g.block_tokens(block_tokens),
            pages_per_chunk=layout.pages_per_chunk(g.group_id),
            state_pages_per_seq=per_seq.get(g.group_id),
            draft=g.is_draft,
        )
        for g in spec.groups
    )
    padding = (
        memory_bytes
        - layout.total_bytes
        + sum(
            layout.padding_bytes_per_chunk(g.group_id)
            * -(-num_seqs * per_seq[g.group_id] // layout.pages_per_chunk(g.group_id))
            for g in spec.groups
            if g.is_recurrent
        )
    )
    return Plan(
        model=spec.name,
        memory_bytes=memory_bytes,
        block_tokens=block_tokens,
        max_num_seqs=num_seqs,
        max_model_len=seq_len,
        kv_bytes_per_token=a,
        state_bytes_per_seq=s,
        layout=layout,
        groups=groups,
        state_chunks=state_chunks,
        kv_capacity_tokens=kv_blocks * block_tokens if a else None,
        physical_limit_tokens=(memory_bytes - num_seqs * state_bytes) // a if a else None,
        max_concurrency=bounds.joint,
        concurrency=bounds,
        padding_waste_bytes=padding,
        unified=unified_baseline(
            spec, memory_bytes, block_tokens, num_seqs, seq_len, num_speculative_tokens
        ),
        warnings=warnings,
        num_speculative_tokens=num_speculative_tokens,
        state_pages_per_seq=per_seq,
    )


def _validate(
    memory_bytes: int, max_num_seqs: int | None, max_model_len: int | None, block_tokens: int
) -> None:
    if memory_bytes <= 0:
        raise PlanError(f"memory must be positive, got {memory_bytes} bytes")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise PlanError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 1:
        raise PlanError(f"max_model_len must be >= 1, got {max_model_len}")
    if block_tokens < 1 or not math.log2(block_tokens).is_integer():
        raise PlanError(f"block size must be a power of two, got {block_tokens}")
