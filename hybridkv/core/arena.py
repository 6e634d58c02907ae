"""The first level of the arena: chunks, each free or owned by one group.

Groups take chunks when they run out of pages and hand them back as soon as every page
in them is free and uncached, so memory flows between recurrent states and attention
KV as the workload shifts (no static split between a state pool and a KV pool).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping

from hybridkv.core.layout import ArenaLayout


def static_split(
    layout: ArenaLayout, recurrent_ids: set[int], state_fraction: float
) -> dict[int, range]:
    """A fixed partition: recurrent groups get the first ``state_fraction`` of the bytes.

    This is SGLang's default (a state pool of ``r / (1 + r)`` of the memory, the KV pool
    the rest, no flow between them); hybridkv itself never uses it. Token groups get the
    remaining chunks and the tail. Each side keeps at least one chunk.

    Raises:
        ValueError: the fraction is not in (0, 1) or the arena has fewer than two chunks.
    """
    if not 0 < state_fraction < 1:
        raise ValueError(f"state fraction must be in (0, 1), got {state_fraction}")
    if layout.num_full_chunks < 2:
        raise ValueError("a static split needs at least two chunks")
    wanted = int(state_fraction * layout.total_bytes) // layout.chunk_bytes
    num_state = min(max(1, wanted), layout.num_full_chunks - 1)
    return {
        g.group_id: range(num_state)
        if g.group_id in recurrent_ids
        else range(num_state, layout.num_chunks)
        for g in layout.pages
    }


class ChunkArena:
    """Chunk ownership. Free chunks are handed out lowest index first (deterministic).

    ``partition`` (default None: any group may own any chunk) pins each group to a
    fixed range of chunks, to emulate designs with a static split between pools.
    """

    def __init__(self, layout: ArenaLayout, partition: Mapping[int, range] | None = None) -> None:
        self.layout = layout
        self.partition = partition
        self._owner: list[int | None] = [None] * layout.num_chunks
        self._free: list[int] = list(range(layout.num_chunks))  # a heap
        self.num_transfers = 0  # chunks that changed owner (handed out after a release)

    @property
    def num_chunks(self) -> int:
        return self.layout.num_chunks

    @property
    def num_free_chunks(self) -> int:
        return len(self._free)

    def owner(self, chunk: int) -> int | None:
        return self._owner[chunk]

    def chunks_of(self, group_id: int) -> list[int]:
        return [c for c, g in enumerate(self._owner) if g == group_id]

    def take(self, group_id: int) -> int | None:
        """Give a free chunk that holds at least one page of the group.

        The tail chunk first, if this group's pages fit it: only some groups can use it
        (attention, usually, not state pages), so taking it before a full chunk leaves the
        full chunks to the groups that need them; the planner counts the tail's pages as
        attention capacity on that basis. Otherwise the lowest free chunk. None when none
        is free.
        """
        tail = self.layout.num_full_chunks
        if self.layout.tail_bytes and self._owner[tail] is None and self.usable(group_id, tail):
            self._free.remove(tail)
            heapq.heapify(self._free)
            self._owner[tail] = group_id
            self.num_transfers += 1
            return tail
        skipped: list[int] = []
        chunk: int | None = None
        while self._free:
            candidate = heapq.heappop(self._free)
            if self.usable(group_id, candidate):
                chunk = candidate
                break
            skipped.append(candidate)
        for c in skipped:
            heapq.heappush(self._free, c)
        if chunk is not None:
            self._owner[chunk] = group_id
            self.num_transfers += 1
        return chunk

    def peek(self, group_id: int) -> int | None:
        """The chunk :meth:`take` would hand the group now (None: none is free). Read-only."""
        tail = self.layout.num_full_chunks
        if self.layout.tail_bytes and self._owner[tail] is None and self.usable(group_id, tail):
            return tail
        usable = [c for c in self._free if self.usable(group_id, c)]
        return min(usable) if usable else None

    def num_free_usable(self, group_ids: Collection[int], limit: int | None = None) -> int:
        """Free chunks that at least one of the groups can use, counted up to ``limit``
        (None: all of them)."""
        if limit is not None and limit <= 0:
            return 0
        count = 0
        for c in self._free:
            if any(self.usable(g, c) for g in group_ids):
                count += 1
                if count == limit:
                    break
        return count

    def take_chunk(self, group_id: int, chunk: int) -> None:
        """Give one particular free chunk back to a group (undoing an eviction)."""
        assert self._owner[chunk] is None, f"chunk {chunk} is not free"
        self._free.remove(chunk)
        heapq.heapify(self._free)
        self._owner[chunk] = group_id

    def release(self, chunk: int) -> None:
        """Return a chunk whose pages are all free and uncached."""
        assert self._owner[chunk] is not None, f"chunk {chunk} is already free"
        self._owner[chunk] = None
        heapq.heappush(self._free, chunk)

    def usable(self, group_id: int, chunk: int) -> bool:
        """Whether the group's pages fit the chunk and the partition (if any) allows it."""
        if self.partition is not None and chunk not in self.partition[group_id]:
            return False
        return self.layout.pages_in_chunk(group_id, chunk) > 0

    def has_free_for(self, group_id: int) -> bool:
        return any(self.usable(group_id, c) for c in self._free)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a chunk is free twice"
        for c, owner in enumerate(self._owner):
            assert (owner is None) == (c in free), f"chunk {c}: owner {owner} vs free list"
