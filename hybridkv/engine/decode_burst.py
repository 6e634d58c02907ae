"""Decode bursts: several greedy decode steps back to back per scheduling round.

Why: on a small model a decode step's forward is a few milliseconds (the decode graph,
hybridkv.models.decode_graph), and the engine's Python around it (schedule, batch, sample,
stop checks, outputs) costs as much again: 64 decodes of the tests' tiny Qwen3.5 ran
~2.8 ms in the graph and ~3.8 ms around it. A burst schedules each decoding sequence for
up to ``decode_burst`` positions at once and runs the graph that many times, each
forward's argmax fed back as the next input on the device, so the round's Python is paid
once per burst and the per-token Python is the stop check alone (vLLM v0's multi-step
scheduling, ``num_scheduler_steps``, did this for the same reason).

When (:func:`plan_burst`): every running sequence decodes, is plain greedy (its token is
its raw argmax: no processors, penalties, grammar or logprobs, the sampler's
``is_plain_greedy``) and nobody waits (a burst round admits nobody, so a waiting request
would wait a burst). Each sequence's burst stops where it must stop anyway: its
``max_tokens`` and ``max_model_len``. It still runs past a stop token or string, which
only the tokens show: the engine keeps the tokens up to the stop and finishes the
sequence, so the state and KV computed past it are never used (the manager drops the
snapshots reserved past the kept tokens).

Exactness: each forward is the decode graph's, on the same inputs a plain decode step
gives it (the token, its position, the tables and the live page); the argmax is the one
``greedy_batch`` takes; the snapshots inside a burst are the live page copied right
after the forward of their position, as a plain decode step copies them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.core.manager import CacheManager, StateCopy
from hybridkv.engine.sampler import NO_TOKEN_ALLOWED, SampledToken, SamplingFailure
from hybridkv.forward.batch import ForwardBatch
from hybridkv.models.decode_graph import DecodeGraph
from hybridkv.ops.host_tensors import long_tensor
from hybridkv.sched.request import Sequence
from hybridkv.sched.scheduler import ScheduledChunk


def plan_burst(
    running: Iterable[Sequence],
    max_burst: int,
    max_model_len: int,
    plain_greedy: Callable[[Sequence], bool],
) -> bool:
    """Give every running sequence its ``num_burst_tokens`` for the next round (module doc:
    all or none); whether any got one. ``max_burst``: tokens a round may produce per
    sequence (1: no bursts)."""
    seqs = list(running)
    if max_burst <= 1 or not seqs:
        return False
    if not all(s.num_computed == s.num_tokens - 1 and plain_greedy(s) for s in seqs):
        return False
    planned = False
    for seq in seqs:
        room = max_model_len - seq.num_tokens  # tokens it may still produce
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_outputs)
        seq.num_burst_tokens = max(0, min(max_burst, room) - 1)
        planned = planned or seq.num_burst_tokens > 0
    return planned


@dataclass(frozen=True, slots=True)
class BurstTokens:
    """A burst round's tokens: ``tokens[i][j]`` is chunk i's token after its j-th forward,
    ``finite[i][j]`` whether that token's logit was finite (a NaN or all -inf row has
    no token to give); chunk i has ``1 + num_burst_tokens`` of them."""

    tokens: list[list[int]]
    finite: list[list[bool]]

    def sampled(
        self, chunks: list[ScheduledChunk]
    ) -> dict[int, list[SampledToken] | SamplingFailure]:
        """The engine's per-chunk samples: the tokens in order, or a failure of the
        sequence if any of its forwards had no token (its request ends there)."""
        results: dict[int, list[SampledToken] | SamplingFailure] = {}
        for i, chunk in enumerate(chunks):
            width = 1 + chunk.num_burst_tokens
            if not all(self.finite[i][:width]):
                results[i] = SamplingFailure(NO_TOKEN_ALLOWED)
                continue
            results[i] = [SampledToken(t, None, []) for t in self.tokens[i][:width]]
        return results


def run_burst(
    graph: DecodeGraph,
    batch: ForwardBatch,
    chunks: list[ScheduledChunk],
    manager: CacheManager,
    copy_pages: Callable[[Iterable[StateCopy]], None],
    own_groups: set[int],
) -> BurstTokens:
    """Run ``chunks`` (decodes, each ``1 + num_burst_tokens`` forwards) through ``graph``
    from ``batch``, the ForwardBatch of their known tokens. A chunk leaves the batch after
    its last forward; its snapshots are copied from its live page after the forward that
    reaches their position."""
    assert batch.has_initial_state is not None
    widths = [1 + c.num_burst_tokens for c in chunks]
    steps = max(widths)
    tables, pages = _tables(batch, graph), _pages(batch, graph)
    fresh = ~batch.has_initial_state
    ids, positions = batch.input_ids, batch.positions
    device = ids.device
    tokens = torch.empty(len(chunks), steps, dtype=torch.long, device=device)
    finite = torch.ones(len(chunks), steps, dtype=torch.bool, device=device)
    due = _snapshots_by_forward(chunks, manager, own_groups)
    rows = list(range(len(chunks)))
    index: Tensor | None = None  # the rows still running, where fewer than all
    for j in range(steps):
        still = [i for i in rows if widths[i] > j]
        if len(still) < len(rows):  # some chunks are done (j > 0): the rest go on alone
            rows = still
            index = long_tensor(rows, device)
            tables = [t[index] for t in _tables(batch, graph)]
            pages = [p[index] for p in _pages(batch, graph)]
            fresh = fresh[: len(rows)]  # all False after the first forward
            positions = batch.positions[index] + j
            ids = tokens[index, j - 1]
        logits = graph.run(ids, positions, tables, pages, fresh)
        chosen = logits.argmax(dim=-1)
        ok = torch.isfinite(logits.gather(1, chosen[:, None]))[:, 0]
        if index is None:
            tokens[:, j] = chosen
            finite[:, j] = ok
        else:
            tokens[index, j] = chosen
            finite[index, j] = ok
        copy_pages(due.get(j, ()))
        ids, positions = chosen, positions + 1
        if j == 0:
            fresh = torch.zeros_like(fresh)  # every state has been written now
    return BurstTokens(tokens.tolist(), finite.tolist())


def _tables(batch: ForwardBatch, graph: DecodeGraph) -> list[Tensor]:
    """The block table of each of ``graph``'s attention groups, in its plan's order."""
    return [batch.block_tables[g] for g in graph.plan.attention_groups]


def _pages(batch: ForwardBatch, graph: DecodeGraph) -> list[Tensor]:
    """The live state pages of each of ``graph``'s recurrent groups, in its plan's order."""
    return [batch.state_pages[g] for g in graph.plan.recurrent_groups]


def _snapshots_by_forward(
    chunks: list[ScheduledChunk], manager: CacheManager, own_groups: set[int]
) -> dict[int, list[StateCopy]]:
    """Forward index j -> the snapshot copies due after it: a snapshot at ``position`` of
    a chunk from ``start`` holds the state after the forward of position - 1, the
    (position - 1 - start)-th."""
    due: dict[int, list[StateCopy]] = {}
    for chunk in chunks:
        for snap in chunk.allocation.snapshots:
            if snap.group_id not in own_groups:
                continue
            live = manager.live_page(chunk.seq.seq_id, snap.group_id)
            due.setdefault(snap.position - 1 - chunk.start, []).append(
                StateCopy(snap.group_id, live, snap.page)
            )
    return due
