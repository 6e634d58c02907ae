"""Sliding-window attention: blocks that fall out of the window are released.

A hit at length L needs only the blocks the next token can see, those covering
``[L - window + 1, L)``; earlier entries of the table are the null page.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.core.groups.attention import AttentionGroup
from hybridkv.core.groups.base import CachedRequest
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import NULL_PAGE, ReqId
from hybridkv.core.spec import SlidingWindowSpec


class SlidingWindowGroup(AttentionGroup):
    @property
    def window_tokens(self) -> int:
        spec = self.group.spec
        assert isinstance(spec, SlidingWindowSpec)
        return spec.window_tokens

    def _first_needed_block(self, num_tokens: int) -> int:
        """First block a query at position ``num_tokens`` can still attend to."""
        return max(0, num_tokens - self.window_tokens + 1) // self.block_tokens

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> int:
        limit = min(len(hashes), max_tokens // self.block_tokens)
        run = 0  # cached blocks in a row ending at block i
        best = 0
        for i in range(limit):
            run = run + 1 if self.pool.lookup(hashes[i]) is not None else 0
            length = (i + 1) * self.block_tokens
            if run >= i + 1 - self._first_needed_block(length):
                best = length
        return best

    def take_hit(self, req_id: ReqId, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        assert not table, f"request {req_id} already holds pages"
        first = self._first_needed_block(num_tokens)
        table.extend([NULL_PAGE] * first)
        for block_hash in hashes[first : num_tokens // self.block_tokens]:
            page = self.pool.lookup(block_hash)
            assert page is not None, "hit pages must be checked before they are taken"
            self.pool.touch(page, self.allocator.clock)
            table.append(page)
        self._num_cached_blocks[req_id] = len(table)

    def cache(self, req_id: ReqId, req: CachedRequest) -> None:
        """Publish full blocks, then release the blocks no future query can see."""
        super().cache(req_id, req)
        table = self.tables.get(req_id, [])
        for i in range(min(self._first_needed_block(req.num_computed), len(table))):
            if table[i] != NULL_PAGE:
                self.pool.release(table[i], self.allocator.clock)
                table[i] = NULL_PAGE
