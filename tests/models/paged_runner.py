"""A test-side paged cache driver: allocator + ForwardBatch builder over one arena.

The allocator gives every group whole chunks, as the real core does, and hands out pages in
a scrambled order so that an indexing bug (page id vs block index, group A's page read
through group B's view) shows. The arena starts filled with 0xFF bytes, which are NaN in
every float dtype: reading an unwritten slot or an uninitialised state poisons the logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews


class ScrambledAllocator:
    """Pages of each group from chunks it owns; chunks and pages in shuffled order."""

    def __init__(self, layout: ArenaLayout, seed: int = 0) -> None:
        self.layout = layout
        self.rng = random.Random(seed)
        self.free_chunks = list(range(layout.num_full_chunks))
        self.rng.shuffle(self.free_chunks)
        self.free_pages: dict[int, list[int]] = {p.group_id: [] for p in layout.pages}

    def allocate(self, group_id: int) -> int:
        if not self.free_pages[group_id]:
            chunk = self.free_chunks.pop()
            first = self.layout.first_page(group_id, chunk)
            pages = list(range(first, first + self.layout.pages_per_chunk(group_id)))
            self.rng.shuffle(pages)
            self.free_pages[group_id] = pages
        return self.free_pages[group_id].pop()


@dataclass
class ReqCache:
    num_computed: int = 0
    blocks: dict[int, list[int]] = field(default_factory=dict)  # attention group -> pages
    state_page: dict[int, int] = field(default_factory=dict)  # recurrent group -> page


class PagedRunner:
    """Runs a model step by step over paged caches, like a minimal engine."""

    def __init__(
        self, model: torch.nn.Module, spec: ModelSpec, block_tokens: int = 16, seed: int = 0
    ) -> None:
        self.model, self.spec, self.block_tokens = model, spec, block_tokens
        memory = 64 * (spec.state_bytes_per_seq + spec.kv_bytes_per_token * 512)
        self.layout = build_layout(spec.groups, block_tokens, memory)
        arena = torch.full((self.layout.total_bytes,), 0xFF, dtype=torch.uint8)
        self.views = CacheViews(spec, self.layout, arena)
        self.allocator = ScrambledAllocator(self.layout, seed)
        self.reqs: dict[str, ReqCache] = {}

    def _reserve(self, req: ReqCache, total_tokens: int) -> None:
        for group in self.spec.groups:
            gid = group.group_id
            if group.is_recurrent:
                if gid not in req.state_page:
                    req.state_page[gid] = self.allocator.allocate(gid)
                continue
            pages = req.blocks.setdefault(gid, [])
            while len(pages) * self.block_tokens < total_tokens:
                pages.append(self.allocator.allocate(gid))

    def build_batch(self, work: list[tuple[str, list[int]]], all_logits: bool) -> ForwardBatch:
        ids, positions, starts, computed = [], [], [0], []
        for req_id, tokens in work:
            req = self.reqs.setdefault(req_id, ReqCache())
            self._reserve(req, req.num_computed + len(tokens))
            ids += tokens
            positions += range(req.num_computed, req.num_computed + len(tokens))
            starts.append(len(ids))
            computed.append(req.num_computed)
        reqs = [self.reqs[r] for r, _ in work]
        tables = {}
        for group in self.spec.groups:
            if not group.is_recurrent:
                width = max(len(r.blocks[group.group_id]) for r in reqs) + 2  # -1 padding
                rows = [r.blocks[group.group_id] + [-1] * width for r in reqs]
                tables[group.group_id] = torch.tensor([row[:width] for row in rows])
        states = {
            g.group_id: torch.tensor([r.state_page[g.group_id] for r in reqs])
            for g in self.spec.groups
            if g.is_recurrent
        }
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            query_start_loc=torch.tensor(starts),
            num_computed_tokens=torch.tensor(computed),
            block_tables=tables,
            state_pages=states,
            logits_indices=torch.arange(len(ids)) if all_logits else None,
        )

    def step(self, work: list[tuple[str, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits [R, vocab] (or [T, vocab] with ``all_logits``)."""
        batch = self.build_batch(work, all_logits)
        logits = self.model(batch, self.views)
        for req_id, tokens in work:
            self.reqs[req_id].num_computed += len(tokens)
        return logits

    def prefill_chunks(self, req_id: str, ids: list[int], sizes: list[int]) -> torch.Tensor:
        """Prefill in chunks of ``sizes`` (the rest in one last chunk); all-position logits."""
        out, pos = [], 0
        for size in [*sizes, len(ids)]:
            if pos >= len(ids):
                break
            chunk = ids[pos : pos + size]
            out.append(self.step([(req_id, chunk)], all_logits=True))
            pos += len(chunk)
        return torch.cat(out)

    def greedy(
        self, req_id: str, ids: list[int], num_tokens: int
    ) -> tuple[list[int], torch.Tensor]:
        """Prefill then decode one token per step: (tokens, [num_tokens, vocab] logits)."""
        logits = [self.step([(req_id, ids)])[0]]
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < num_tokens:
            logits.append(self.step([(req_id, [tokens[-1]])])[0])
            tokens.append(int(logits[-1].argmax()))
        return tokens, torch.stack(logits)
