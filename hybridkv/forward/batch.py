"""ForwardBatch: one engine step's tokens, flat and request-major.

A step mixes prefill chunks and decodes of many requests in one flat token axis, the way
vLLM's v1 runner does: request ``r`` owns rows ``query_start_loc[r]:query_start_loc[r+1]``.
The batch carries page ids, not tensors: every layer reads and writes its cache through
:class:`hybridkv.forward.views.CacheViews`, indexed by these ids.

Per request (``num_computed`` = tokens already in the cache, ``n`` = tokens in this step)::

    positions  | 0 ............ num_computed-1 | num_computed ... num_computed+n-1 |
               |<-- in the pages (KV / state)->|<---- this step's rows in T ------>|
    attention reads positions [0, num_computed + n), writes [num_computed, num_computed + n)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, cast

from torch import Tensor

from hybridkv.forward.views import AttentionView
from hybridkv.ops.paged_attention import AttentionPlan, build_attention_plan
from hybridkv.ops.paged_state import StateBatch, StateCaptures

T = TypeVar("T")


@dataclass(eq=False)
class ForwardBatch:
    """The model input of one step.

    Attributes:
        input_ids: [T] int64 token ids, request-major.
        positions: [T] int64 absolute position of every token.
        query_start_loc: [R+1] int64 row offsets of each request in T.
        num_computed_tokens: [R] int64 tokens already in the cache before this step.
        block_tables: attention group id -> [R, max_blocks] int64 page ids; entries past the
            sequence or outside a sliding window may be -1 and are never read.
        state_pages: recurrent group id -> [R] int64 live state page of each request.
        has_initial_state: [R] bool; False means the state page holds garbage and the
            recurrent layers start from zeros (the page is overwritten).
        logits_indices: [R] int64 row of T whose logits are returned for each request.
        state_captures: recurrent group id -> states to capture during the step: after row
            ``rows[i]`` of T, every recurrent layer of the group writes its state (conv and
            SSM) into page ``pages[i]`` of its view (issue 12's snapshots, issue 16's
            speculative rollback). Empty: no captures.
    """

    input_ids: Tensor
    positions: Tensor
    query_start_loc: Tensor
    num_computed_tokens: Tensor
    block_tables: dict[int, Tensor] = field(default_factory=dict)
    state_pages: dict[int, Tensor] = field(default_factory=dict)
    has_initial_state: Tensor | None = None
    logits_indices: Tensor | None = None
    state_captures: dict[int, StateCaptures] = field(default_factory=dict)
    _state_batches: dict[int, StateBatch] = field(default_factory=dict, init=False, repr=False)
    _attention_plans: dict[tuple[int, int, int | None, int], AttentionPlan] = field(
        default_factory=dict, init=False, repr=False
    )
    _per_step: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.has_initial_state is None:
            self.has_initial_state = self.num_computed_tokens > 0
        if self.logits_indices is None:
            self.logits_indices = self.query_start_loc[1:] - 1

    # Host-side copies of the metadata and the ops' index tensors, computed once per step
    # (not once per layer).

    def per_step(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` the first time ``key`` is asked for in this step, then the same
        value: what every layer of a kind derives alike (RoPE's cos/sin tables)."""
        if key not in self._per_step:
            self._per_step[key] = compute()
        return cast(T, self._per_step[key])

    @property
    def num_requests(self) -> int:
        return int(self.query_start_loc.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @cached_property
    def starts(self) -> list[int]:
        """Host copy of query_start_loc (R+1 entries)."""
        return [int(x) for x in self.query_start_loc.tolist()]

    @cached_property
    def query_lens(self) -> list[int]:
        """Tokens of each request in this step."""
        return [b - a for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]

    @cached_property
    def seq_lens(self) -> list[int]:
        """Tokens of each request in the cache after this step (num_computed + n)."""
        computed = self.num_computed_tokens.tolist()
        return [int(c) + n for c, n in zip(computed, self.query_lens, strict=True)]

    @cached_property
    def initial_state_flags(self) -> list[bool]:
        assert self.has_initial_state is not None
        return [bool(x) for x in self.has_initial_state.tolist()]

    def attention_plan(self, view: AttentionView, decode_key_multiple: int = 1) -> AttentionPlan:
        """The paged-attention index tensors of ``view``'s group, built on the first call of
        the step and shared by every layer of the group (same tables, block size, window);
        ``decode_key_multiple``: see :func:`~hybridkv.ops.paged_attention.build_attention_plan`."""
        key = (view.group_id, view.block_tokens, view.window_tokens, decode_key_multiple)
        plan = self._attention_plans.get(key)
        if plan is None:
            plan = self._attention_plans[key] = build_attention_plan(
                self.block_tables[view.group_id],
                self.starts,
                self.seq_lens,
                self.positions,
                view.block_tokens,
                view.window_tokens,
                decode_key_multiple,
            )
        return plan

    def state_batch(self, group_id: int) -> StateBatch:
        """The step's rows, live pages and captures of recurrent group ``group_id``.

        Built once per step and group: every layer of the group passes it to its ops, which
        derive their index layouts from it once (it caches them).
        """
        if group_id not in self._state_batches:
            self._state_batches[group_id] = StateBatch(
                self.starts,
                self.state_pages[group_id],
                self.initial_state_flags,
                self.state_captures.get(group_id),
            )
        return self._state_batches[group_id]
