"""Where each layer's tensors sit inside a page, and how pages tile the arena.

The arena is one flat byte buffer cut into equal chunks (plus one shorter tail chunk).
Every chunk size is a multiple of every page size of the groups that use it, so each
group can view the whole arena as an array of its own pages::

    page_id = byte_offset // page_bytes          # the same rule for every group

    arena   |<------ chunk 0 ------>|<------ chunk 1 ------>| ... |<- tail ->|
    attn    | p0 | p1 | p2 | ... |pk| ...                        | pages    |
    state   |   s0   |   s1   |pad|   s2   |   s3   |pad| ...    | (unused) |

A state group's page is padded up to ``chunk_bytes // pages_per_chunk`` so that its
pages stay aligned; the padding is the waste the planner keeps under 1%.
Inside a page the layers of the group sit side by side, in group order; each layer's
tensors are listed by :class:`TensorSlot` with a byte offset from the page start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.core.spec import (
    GroupSpec,
    RecurrentStateSpec,
    dtype_bytes,
)

ALIGN_BYTES = 16  # every tensor and page starts on this boundary (largest element: fp32 x4)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSlot:
    """One tensor of one layer inside a page."""

    layer_index: int  # decoder layer
    name: str  # "key", "value", or a state tensor name ("conv", "ssm")
    offset_bytes: int  # from the start of the page
    shape: tuple[int, ...]  # attention: [block_tokens, num_kv_heads, head_dim]
    dtype: str

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class PageLayout:
    """The tensors of one group's page and the page's size before and after padding."""

    group_id: int
    slots: tuple[TensorSlot, ...]
    used_bytes: int  # bytes the tensors need (aligned)
    page_bytes: int  # stride between pages in the arena (>= used_bytes)

    def slot(self, layer_index: int, name: str) -> TensorSlot:
        for s in self.slots:
            if s.layer_index == layer_index and s.name == name:
                return s
        raise KeyError(f"group {self.group_id} has no tensor {name!r} for layer {layer_index}")


def page_tensors(group: GroupSpec, block_tokens: int) -> tuple[tuple[TensorSlot, ...], int]:
    """Tensor slots of one page of ``group`` and the aligned bytes they take."""
    slots: list[TensorSlot] = []
    offset = 0
    for layer in group.layers:
        spec = layer.spec
        if isinstance(spec, RecurrentStateSpec):
            parts = [(t.name, t.shape, t.dtype) for t in spec.tensors]
        else:
            parts = [
                ("key", (block_tokens, spec.num_kv_heads, spec.head_dim), spec.dtype),
                ("value", (block_tokens, spec.num_kv_heads, spec.value_head_dim), spec.dtype),
            ]
        for name, shape, dtype in parts:
            offset = _round_up(offset, ALIGN_BYTES)
            slot = TensorSlot(
                layer_index=layer.layer_index,
                name=name,
                offset_bytes=offset,
                shape=shape,
                dtype=dtype,
            )
            slots.append(slot)
            offset += slot.num_bytes
    return tuple(slots), _round_up(offset, ALIGN_BYTES)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArenaLayout:
    """How the arena is cut: chunk size, chunk count, and every group's page layout.

    ``pages_per_chunk[g]`` pages of group ``g`` fit a full chunk. The tail chunk (the
    memory left after the full chunks) belongs to the attention groups only: it exists to
    hold KV, the planner counts it as KV capacity, and a state page there would take it
    from them while full chunks, which only states need, stay free.
    """

    chunk_bytes: int
    num_full_chunks: int
    tail_bytes: int
    pages: tuple[PageLayout, ...]  # indexed by group id
    tail_group_ids: frozenset[int] = frozenset()  # groups whose pages may use the tail

    @property
    def num_chunks(self) -> int:
        return self.num_full_chunks + (1 if self.tail_bytes else 0)

    @property
    def total_bytes(self) -> int:
        return self.num_full_chunks * self.chunk_bytes + self.tail_bytes

    def pages_per_chunk(self, group_id: int) -> int:
        return self.chunk_bytes // self.pages[group_id].page_bytes

    def pages_in_chunk(self, group_id: int, chunk_index: int) -> int:
        if chunk_index < self.num_full_chunks:
            return self.pages_per_chunk(group_id)
        if group_id not in self.tail_group_ids:
            return 0
        return self.tail_bytes // self.pages[group_id].page_bytes

    def num_pages(self, group_id: int) -> int:
        """Size of the group's page-id space over the whole arena (its view's length)."""
        return self.total_bytes // self.pages[group_id].page_bytes

    def chunk_of(self, group_id: int, page_id: int) -> int:
        return page_id // self.pages_per_chunk(group_id)

    def first_page(self, group_id: int, chunk_index: int) -> int:
        return chunk_index * self.pages_per_chunk(group_id)

    def padding_bytes_per_chunk(self, group_id: int) -> int:
        """Bytes of a full chunk that the group's pages cannot use."""
        return self.chunk_bytes - self.pages_per_chunk(group_id) * self.pages[group_id].used_bytes


def choose_chunk_bytes(
    used_page_bytes: dict[int, int], recurrent: set[int], *, max_waste: float = 0.005
) -> tuple[int, dict[int, int]]:
    """Pick the chunk size and every group's padded page size.

    Token (attention) pages keep their exact size, so the chunk is a multiple of their
    LCM. Each state group gets ``ppc = chunk // used`` pages, padded to ``chunk // ppc``.
    The smallest chunk whose state padding stays under ``max_waste`` wins: smaller chunks
    let memory move between groups at a finer grain.

    Returns:
        (chunk_bytes, page_bytes per group id)
    """
    token_pages = [b for g, b in used_page_bytes.items() if g not in recurrent]
    unit = math.lcm(ALIGN_BYTES, *token_pages)
    if not recurrent:
        return unit, dict(used_page_bytes)
    largest_state = max(used_page_bytes[g] for g in recurrent)
    best: tuple[float, int, dict[int, int]] | None = None
    for multiple in range(1, 65):
        chunk = _round_up(multiple * largest_state, unit)
        padded = _padded_state_pages(chunk, used_page_bytes, recurrent)
        if padded is None:
            continue
        waste = max(
            (chunk - (chunk // used_page_bytes[g]) * used_page_bytes[g]) / chunk for g in recurrent
        )
        if waste <= max_waste:
            return chunk, {**used_page_bytes, **padded}
        if best is None or waste < best[0]:
            best = (waste, chunk, {**used_page_bytes, **padded})
    if best is None:  # no aligned candidate at all: fall back to one state page per chunk
        chunk = _round_up(largest_state, unit)
        return chunk, {**used_page_bytes, **dict.fromkeys(recurrent, chunk)}
    return best[1], best[2]


def _padded_state_pages(
    chunk: int, used_page_bytes: dict[int, int], recurrent: set[int]
) -> dict[int, int] | None:
    padded: dict[int, int] = {}
    for g in recurrent:
        per_chunk = chunk // used_page_bytes[g]
        if chunk % per_chunk or (chunk // per_chunk) % ALIGN_BYTES:
            return None
        padded[g] = chunk // per_chunk
    return padded


def build_layout(
    groups: tuple[GroupSpec, ...], block_tokens: int, memory_bytes: int
) -> ArenaLayout:
    """Cut ``memory_bytes`` into chunks for these groups.

    Raises:
        ValueError: the memory does not hold one chunk.
    """
    tensors = {g.group_id: page_tensors(g, block_tokens) for g in groups}
    used = {gid: used for gid, (_, used) in tensors.items()}
    recurrent = {g.group_id for g in groups if g.is_recurrent}
    chunk, page_bytes = choose_chunk_bytes(used, recurrent)
    if memory_bytes < chunk:
        raise ValueError(
            f"cache memory {memory_bytes} B is smaller than one chunk ({chunk} B, "
            f"the largest page rounded to the attention pages)"
        )
    num_full, rest = divmod(memory_bytes, chunk)
    smallest_token_page = min((page_bytes[g] for g in used if g not in recurrent), default=chunk)
    tail = rest - rest % smallest_token_page if rest >= smallest_token_page else 0
    pages = tuple(
        PageLayout(
            group_id=gid, slots=tensors[gid][0], used_bytes=used[gid], page_bytes=page_bytes[gid]
        )
        for gid in sorted(used)
    )
    return ArenaLayout(
        chunk_bytes=chunk,
        num_full_chunks=num_full,
        tail_bytes=tail,
        pages=pages,
        tail_group_ids=frozenset(used) - recurrent,
    )
