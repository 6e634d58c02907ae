"""The first level of the arena: chunks, each free or owned by one group.

Groups take chunks when they run out of pages and hand them back as soon as every page
in them is free and uncached, so memory flows between recurrent states and attention
KV as the workload shifts (no static split between a state pool and a KV pool).
"""

from __future__ import annotations

import heapq

from hybridkv.core.layout import ArenaLayout


class ChunkArena:
    """Chunk ownership. Free chunks are handed out lowest index first (deterministic)."""

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
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
        """Give the lowest free chunk that holds at least one page of the group.

        Returns None when none is free. The tail chunk is skipped for groups whose
        page does not fit it (state pages, usually).
        """
        skipped: list[int] = []
        chunk: int | None = None
        while self._free:
            candidate = heapq.heappop(self._free)
            if self.layout.pages_in_chunk(group_id, candidate) > 0:
                chunk = candidate
                break
            skipped.append(candidate)
        for c in skipped:
            heapq.heappush(self._free, c)
        if chunk is not None:
            self._owner[chunk] = group_id
            self.num_transfers += 1
        return chunk

    def release(self, chunk: int) -> None:
        """Return a chunk whose pages are all free and uncached."""
        assert self._owner[chunk] is not None, f"chunk {chunk} is already free"
        self._owner[chunk] = None
        heapq.heappush(self._free, chunk)

    def has_free_for(self, group_id: int) -> bool:
        return any(self.layout.pages_in_chunk(group_id, c) > 0 for c in self._free)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a chunk is free twice"
        for c, owner in enumerate(self._owner):
            assert (owner is None) == (c in free), f"chunk {c}: owner {owner} vs free list"
