"""Where recurrent snapshots are taken, and which ones are kept.

All positions are multiples of ``block_tokens``: a snapshot is keyed by the hash of the
block that ends there. Let P be the prompt length and B the block size::

    prompt end       floor((P - 1) / B) * B     the largest hit a repeat of this prompt
                                                can use (the last token is recomputed)
    branch point     the last block boundary    a prefix other requests share (Marconi's
                     of the prefix the prompt   speculative insertion): the second request
                     shares with what is        behind a system prompt takes it, the
                     cached or running          third and later hit it (the manager finds
                                                it at admission, :meth:`CacheManager.allocate`)
    prefill grid     about every                a long prompt's state every 4096 tokens
                     ``prefill_grid_tokens``    (floored to a block boundary): the first
                     of the prompt              request of a family cannot know that a
                                                later one will branch off its prefix
    interval         every ``interval_tokens``  dense grid, off by default
    sequence end     each boundary crossed in   the next chat turn resumes here; only
                     decode                     the latest survives unless retained

Every position inside a chunk ``(start, end]`` is taken during that chunk's forward
(the runner asks the recurrent ops for the state after that row), so a snapshot costs a
copy, never a step. ``CacheConfig.split_prefill_at_snapshots`` instead cuts prefill
chunks at each position and copies the state after the forward (the engine before
in-forward captures, and the simulator's ``hybridkv-prompt-end`` design).

Retention (``retention_interval_tokens``): once a newer snapshot of the same request
exists, an older one is kept only if it is the prompt end, the branch point, a prefill
grid point or sits on a multiple of the retention interval. Dense snapshots evict the
attention prefixes they belong to (vLLM PR #45845: ~80% of blocks at block size 128), so
sparse is the default.

What a request *holds* is separate from what the cache keeps: by default only its live
state and its newest snapshot (the ``release_*``, ``reuse_*`` and ``demote_*`` knobs; why
and the measurements are in docs/architecture.md §3 and docs/simulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPolicy:
    interval_tokens: int | None = None
    # a prompt's state about every N tokens of its prefill (each grid point floored to a
    # block boundary; None: off). A request that arrives while its prefix's first user
    # is still running, or after it, has no branch point snapshot to resume from (it is
    # taken by the second request); the grid gives it one near the shared prefix's end
    # for a state page per N tokens. issue 12, docs/architecture.md §3
    prefill_grid_tokens: int | None = 4096
    at_prompt_end: bool = True
    at_sequence_end: bool = True
    # snapshot where the prompt's shared prefix ends when no snapshot covers it yet
    at_branch_points: bool = True
    retention_interval_tokens: int | None = None
    # sequence-end snapshots only on multiples of this (None: every block boundary)
    decode_interval_tokens: int | None = None
    # a request holds only its newest snapshot; superseded ones that retention keeps are
    # released to the cache (ref 0, evictable) instead of pinned until the request ends
    release_superseded: bool = True
    # the newest snapshot's page is rewritten in place at the next checkpoint when
    # retention would drop it anyway (no new page, no eviction per decode boundary)
    reuse_superseded_page: bool = True
    # released superseded snapshots go to the front of the eviction queue (a branch
    # point, shared by design, keeps its place)
    demote_superseded: bool = True
    # a running request does not hold even its newest snapshot: it is cached at the
    # front of the eviction queue ("parked") and moved to the back when the request ends
    release_newest: bool = True
    # the snapshot a request resumed from is released (and demoted) once its restore ran
    # if it covers sampled tokens (a previous turn's end); prompt snapshots stay held
    release_generated_hit: bool = True

    def validate(self, block_tokens: int) -> None:
        """Raises ValueError for intervals that are not positive multiples of the block."""
        grid = self.prefill_grid_tokens
        if grid is not None and grid <= 0:  # any positive N: its points floor to blocks
            raise ValueError(f"checkpoint prefill_grid_tokens={grid} must be positive")
        for name in ("interval_tokens", "retention_interval_tokens", "decode_interval_tokens"):
            value = getattr(self, name)
            if value is not None and (value <= 0 or value % block_tokens):
                raise ValueError(
                    f"checkpoint {name}={value} must be a positive multiple of the "
                    f"block size {block_tokens}"
                )

    def on_prefill_grid(self, position: int, block_tokens: int) -> bool:
        grid = self.prefill_grid_tokens
        return grid is not None and _grid_point(position, grid, block_tokens)

    @staticmethod
    def prompt_end(prompt_len: int, block_tokens: int) -> int:
        return max(0, (prompt_len - 1) // block_tokens * block_tokens)

    def is_checkpoint(self, position: int, prompt_len: int, block_tokens: int) -> bool:
        """Whether the state after exactly ``position`` tokens should be snapshotted.

        Branch points are per request and not known here (see :meth:`positions`).
        """
        if position <= 0 or position % block_tokens:
            return False
        if self.interval_tokens and position % self.interval_tokens == 0:
            return True
        if self.at_prompt_end and position == self.prompt_end(prompt_len, block_tokens):
            return True
        if position < prompt_len and self.on_prefill_grid(position, block_tokens):
            return True
        if not (self.at_sequence_end and position >= prompt_len):
            return False
        return not self.decode_interval_tokens or position % self.decode_interval_tokens == 0

    def positions(
        self, start: int, end: int, prompt_len: int, block_tokens: int, branch_tokens: int = 0
    ) -> list[int]:
        """Every position in ``(start, end]`` to snapshot, ascending.

        ``branch_tokens``: the request's branch point (0: none). The same positions as
        :meth:`is_checkpoint` over the range, found without visiting every block.
        """
        branch_in_range = self.at_branch_points and start < branch_tokens <= end
        if start >= prompt_len and not self.interval_tokens and not branch_in_range:
            # a decode step (the common call, once per running request and step): past the
            # prompt only sequence-end snapshots apply (a branch point is inside the prompt)
            if not self.at_sequence_end:
                return []
            step = self.decode_interval_tokens or block_tokens
            return list(_multiples(start, end, step))
        found: set[int] = set()
        if branch_in_range:
            found.add(branch_tokens)
        if self.at_prompt_end:
            prompt_end = self.prompt_end(prompt_len, block_tokens)
            if start < prompt_end <= end:
                found.add(prompt_end)
        if self.interval_tokens:
            found.update(_multiples(start, end, self.interval_tokens))
        if self.prefill_grid_tokens and start < prompt_len - 1:
            grid = self.prefill_grid_tokens
            last = min(end, prompt_len - 1)
            for k in range(start // grid + 1, (last + block_tokens - 1) // grid + 1):
                point = k * grid // block_tokens * block_tokens
                if start < point <= last:
                    found.add(point)
        if self.at_sequence_end and end >= prompt_len:
            step = self.decode_interval_tokens or block_tokens
            found.update(_multiples(max(start, prompt_len - 1), end, step))
        found.discard(0)
        return sorted(found)

    def keep(
        self, position: int, prompt_len: int, block_tokens: int, branch_tokens: int = 0
    ) -> bool:
        """Whether a superseded snapshot stays cached."""
        if self.at_prompt_end and position == self.prompt_end(prompt_len, block_tokens):
            return True
        if position == branch_tokens:
            return True
        if position < prompt_len and self.on_prefill_grid(position, block_tokens):
            return True
        interval = self.retention_interval_tokens or self.interval_tokens
        return interval is not None and position % interval == 0


def _grid_point(position: int, grid: int, block_tokens: int) -> bool:
    """Whether ``position`` is ``k * grid`` floored to a block boundary for some k >= 1."""
    k = -(-position // grid)
    return position > 0 and k * grid // block_tokens * block_tokens == position


def _multiples(start: int, end: int, step: int) -> range:
    """Multiples of ``step`` in ``(start, end]``."""
    return range((start // step + 1) * step, end + 1, step)
