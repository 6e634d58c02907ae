"""Draft-model proposals: a smaller model with the same vocabulary guesses the next tokens.

The draft model's layers have pages in the target's arena (its groups are part of the one
CacheManager, :func:`hybridkv.core.spec.with_draft`): the core allocates them for the
same token counts as the target's, frees them with the request, and never publishes or
shares them. The draft runs behind the target, only when its sequence speculates::

    forward 1      the tokens it has not seen yet (its prompt after an admission, else the
                   tokens the last step kept), on its own live state, which ends at the
                   sequence's last real token; that state is also captured into the
                   request's draft scratch page (its working state); the logits give d_1
    forwards 2..s  d_1, ..., d_{s-1}, one token each, on the working state: the live state
                   never sees a draft, so nothing has to be rolled back. Their KV lands
                   past the real tokens and is overwritten by the next forward 1

So the draft needs one scratch state per recurrent group and step, and recomputes the
tokens a step kept (a + 1 rows in its next forward 1, cheap next to the target). After a
preemption or a prefix hit of the target it starts from its own zero state: it recomputes
the prompt once (draft-sized work) rather than keeping snapshots of its own.

Drafts are the draft's argmax (a point mass, also at temperature > 0: rejection sampling
stays exact for any proposal distribution). Batched over every speculating sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager
from hybridkv.core.spec import GroupSpec
from hybridkv.engine.runner import page_tables, warm_up_compiled
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.models.base import CausalLM
from hybridkv.ops.paged_state import StateCaptures
from hybridkv.sched.request import Sequence
from hybridkv.sched.scheduler import ScheduledChunk


class DraftModelProposer:
    """Greedy drafts from a draft model on its own pages of the target's arena."""

    free_guess = False  # a guess costs a draft forward

    def __init__(
        self,
        model: CausalLM,
        views: CacheViews,
        groups: list[GroupSpec],
        manager: CacheManager,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        """``views``: the draft's layers numbered from 0; ``groups``: the draft's groups;
        ``max_model_len``: positions the draft model was trained for."""
        self.model = model
        self.views = views
        self.groups = groups
        self.manager = manager
        self.device = device
        self.max_model_len = max_model_len
        self._seen: dict[str, int] = {}  # tokens in the draft's cache, per sequence

    def warm_up_compiled(self) -> None:
        """Compile the draft model's compiled ops for its pages before serving (as the
        target's runner does: hybridkv.engine.runner.warm_up_compiled)."""
        warm_up_compiled(self.model, self.views)

    def available(self, seq: Sequence, limit: int) -> int:
        return max(0, min(limit, self.max_model_len - seq.num_tokens))

    def guess(self, seq_id: str) -> int | None:
        return None

    def forget(self, seq_id: str) -> None:
        self._seen.pop(seq_id, None)

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> None:
        todo = [c for c in chunks if c.num_draft_tokens]
        working = self._working_pages(todo)
        drafts = self._catch_up(todo, working)
        for step in range(1, max(c.num_draft_tokens for c in todo)):
            active = [i for i, c in enumerate(todo) if c.num_draft_tokens > step]
            for i, token in zip(active, self._decode(todo, active, drafts, working), strict=True):
                drafts[i].append(token)
        for chunk, tokens in zip(todo, drafts, strict=True):
            chunk.seq.draft_token_ids = tokens

    def _working_pages(self, todo: list[ScheduledChunk]) -> dict[int, list[int]]:
        """Draft recurrent group -> the working page of each chunk (its scratch page)."""
        pages: dict[int, list[int]] = {g.group_id: [] for g in self.groups if g.is_recurrent}
        for chunk in todo:
            for scratch in chunk.allocation.scratch:
                if scratch.group_id in pages:
                    pages[scratch.group_id].append(scratch.page)
        assert all(len(p) == len(todo) for p in pages.values()), "one working page each"
        return pages

    def _catch_up(
        self, todo: list[ScheduledChunk], working: dict[int, list[int]]
    ) -> list[list[int]]:
        """Forward 1: every token the draft has not seen; its first draft token each."""
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        computed: list[int] = []
        for chunk in todo:
            seq = chunk.seq
            seen, end = self._seen.get(seq.seq_id, 0), chunk.known_end
            ids += seq.all_token_ids[seen:end]
            positions += range(seen, end)
            starts.append(len(ids))
            computed.append(seen)
            self._seen[seq.seq_id] = end
        last_rows = self._tensor([s - 1 for s in starts[1:]])
        captures = {
            gid: StateCaptures(last_rows, self._tensor(pages)) for gid, pages in working.items()
        }
        tables, states = self._pages(todo)
        batch = ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            query_start_loc=self._tensor(starts),
            num_computed_tokens=self._tensor(computed),
            block_tables=tables,
            state_pages=states,
            state_captures=captures,
        )
        return [[token] for token in self._argmax(batch)]

    def _decode(
        self,
        todo: list[ScheduledChunk],
        active: list[int],
        drafts: list[list[int]],
        working: dict[int, list[int]],
    ) -> list[int]:
        """Forwards 2..s: the last draft token of each active chunk, on its working state."""
        chunks = [todo[i] for i in active]
        tables, _ = self._pages(chunks)
        # the draft at position known_end + j - 1 is the j-th one fed (j = len(drafts[i]))
        positions = [todo[i].known_end + len(drafts[i]) - 1 for i in active]
        batch = ForwardBatch(
            input_ids=self._tensor([drafts[i][-1] for i in active]),
            positions=self._tensor(positions),
            query_start_loc=self._tensor(list(range(len(active) + 1))),
            num_computed_tokens=self._tensor(positions),
            block_tables=tables,
            state_pages={
                gid: self._tensor([pages[i] for i in active]) for gid, pages in working.items()
            },
            has_initial_state=torch.ones(len(active), dtype=torch.bool, device=self.device),
        )
        return self._argmax(batch)

    def _pages(self, chunks: list[ScheduledChunk]) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        seq_ids = [ReqId(c.seq.seq_id) for c in chunks]
        return page_tables(self.groups, seq_ids, self.manager, self.device)

    def _argmax(self, batch: ForwardBatch) -> list[int]:
        logits = self.model(batch, self.views)  # [R, vocab]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
