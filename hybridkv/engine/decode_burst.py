"""Decode bursts: several greedy decode steps back to back per scheduling round.

Why: on a small model a decode step's forward is a few milliseconds (the decode graph,
hybridkv.models.decode_graph), and the engine's Python around it (schedule, batch, sample,
stop checks, outputs) costs as much again: 64 decodes of the tests' tiny Qwen3.5 ran
~2.8 ms in the graph and ~3.8 ms around it. A burst schedules each decoding sequence for
up to ``decode_burst`` positions at once and runs the graph that many times, each
forward's argmax fed back as the next input on the device, so the round's Python is paid
once per burst and the per-token Python is the stop check alone (vLLM v0's multi-step
scheduling, ``num_scheduler_steps``, did this for the same reason).

How long (:func:`burst_length`): as many forwards as fit in the engine's
``decode_burst_budget_ms`` (25 ms) at the recent decode rounds' time per forward
(:class:`ForwardTimes`), at most ``decode_burst`` (8): the tiny model's 64-row forward
(~2.5 ms) bursts 8 times, a forward of 40 ms not at all (there the round's Python is a
small part, and the burst would hold a streaming client's tokens back). The offline
``LLM`` sets no budget and bursts of 16 (a block): nobody streams, and a request another
thread adds waits for the step lock anyway (the tiny model's 64 x 32 equal replies in 2
decode rounds, not 4: 5-10% less time).

When (:func:`plan_burst`): every running sequence decodes, is plain greedy (its token is
its raw argmax: no processors, penalties, grammar or logprobs, the sampler's
``is_plain_greedy``) and nobody waits who could be admitted (a burst round admits nobody;
with every seat taken nobody could be). Each sequence's burst stops where it must stop
anyway: its ``max_tokens`` and ``max_model_len``; and at a stop token (its EOS, its
``stop_token_ids``), seen after each forward: the sequence leaves the batch at once, and
if requests wait for a seat the whole burst ends there, so the seat it frees is taken at
the next round, not after the rest of the burst (the others keep the tokens they have
and go on next round: 256 requests of ~19 tokens on 64 seats ran 8% slower with bursts of
16 that did not). A stop string, which only the text shows, is found after the burst: the
engine keeps the tokens up to the stop and finishes the sequence, so the state and KV
computed past it are never used (the manager drops the snapshots reserved past the kept
tokens).

Exactness: each forward is the decode graph's, on the same inputs a plain decode step
gives it (the token, its position, the tables and the live page); the argmax is the one
``greedy_batch`` takes; the snapshots inside a burst are the live page copied right
after the forward of their position, as a plain decode step copies them. What may
differ is the rows beside a request: one that stopped inside the burst stays in the batch
to its last forward, and the graph's matmuls may round a row differently at another batch
size (hybridkv.models.decode_graph), so replies equal one-token steps' up to that
rounding (exactly, in the engine tests). A burst ends before any snapshot position past
its first token (``CacheManager.burst_end``), so a stop inside it never costs the
request's last snapshot.

Costs: the tokens of a burst reach the client together, and the server's inter-token
latency sees one gap per burst; a request arriving during a burst waits for its end to be
admitted. The time budget bounds both to about 25 ms.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Collection, Iterable, Iterator
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

# How long a burst may take by default (EngineConfig.decode_burst_budget_ms): the forwards
# it runs are the wait of a client streaming its tokens (they arrive together) and of a
# request arriving meanwhile. A burst saves the round's Python (a few milliseconds) per
# forward, which matters only while a forward is short; so a burst runs as many forwards as
# fit in this budget (the recent decode rounds' time per forward), at most ``decode_burst``.
BURST_BUDGET_S = 0.025


class ForwardTimes:
    """Seconds per forward of the last few rounds of decodes alone, whose median sets how
    long a burst may be (:func:`burst_length`). The median, not the last round's: on a
    shared machine one round slowed 2-5x by another process would cut the next bursts
    short, and each shorter burst costs a round's Python more (the tiny model's 64 x 32
    tokens ran in 5 to 9 rounds as the last round's time came out)."""

    def __init__(self, keep: int = 5) -> None:
        self._times: collections.deque[float] = collections.deque(maxlen=keep)

    def add(self, seconds_per_forward: float) -> None:
        self._times.append(seconds_per_forward)

    @property
    def typical(self) -> float | None:
        """The median of the rounds kept; None before the first."""
        return statistics.median(self._times) if self._times else None


def burst_length(
    max_burst: int, forward_s: float | None, budget_s: float | None = BURST_BUDGET_S
) -> int:
    """Tokens a round may produce per sequence: as many forwards of ``forward_s`` seconds
    as fit in ``budget_s``, between 1 and ``max_burst``; 1 (a plain step, which measures
    it) while the forward's time is unknown. No budget (None): ``max_burst``."""
    if budget_s is None:
        return max_burst
    if forward_s is None or forward_s <= 0:
        return 1
    return max(1, min(max_burst, int(budget_s / forward_s)))


def plan_burst(
    running: Iterable[Sequence],
    max_burst: int,
    max_model_len: int,
    plain_greedy: Callable[[Sequence], bool],
) -> None:
    """Give every running sequence its ``num_burst_tokens`` for the next round (module doc:
    all or none; a sequence the last round skipped loses what it had). ``max_burst``:
    tokens a round may produce per sequence (1: no bursts)."""
    seqs = list(running)
    for seq in seqs:
        seq.num_burst_tokens = 0
    if max_burst <= 1:
        return
    if not all(s.num_computed == s.num_tokens - 1 and plain_greedy(s) for s in seqs):
        return
    for seq in seqs:
        room = max_model_len - seq.num_tokens  # tokens it may still produce
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_outputs)
        seq.num_burst_tokens = max(0, min(max_burst, room) - 1)


@dataclass(frozen=True, slots=True)
class BurstTokens:
    """A burst round's tokens: ``tokens[i][j]`` is chunk i's token after its j-th forward,
    ``finite[i][j]`` whether that token's logit was finite (a NaN or all -inf row has
    no token to give); chunk i has ``widths[i]`` of them: ``1 + num_burst_tokens``, or
    fewer after a stop token (its own, or another's that ended the burst)."""

    tokens: list[list[int]]
    finite: list[list[bool]]
    widths: list[int]

    @property
    def forwards(self) -> int:
        """The forwards the burst ran."""
        return max(self.widths)

    def sampled(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[dict[int, list[SampledToken] | SamplingFailure], set[int]]:
        """(the engine's per-chunk samples, the chunks whose sampling failed after them).

        A chunk's tokens up to its first forward without a token: all of them, or a
        failure if the first had none. If a later one had none, the tokens before it are
        its samples and the chunk is in the set: its sequence fails after them unless
        they stop it (as one-token steps would have given them, then failed).
        """
        results: dict[int, list[SampledToken] | SamplingFailure] = {}
        failed: set[int] = set()
        for i in range(len(chunks)):
            width = self.widths[i]
            good = self.finite[i][:width]
            kept = good.index(False) if not all(good) else width
            if kept == 0:
                results[i] = SamplingFailure(NO_TOKEN_ALLOWED)
                continue
            results[i] = [SampledToken(t, None, []) for t in self.tokens[i][:kept]]
            if kept < width:
                failed.add(i)
        return results, failed


def run_burst(
    graph: DecodeGraph,
    batch: ForwardBatch,
    chunks: list[ScheduledChunk],
    manager: CacheManager,
    copy_pages: Callable[[Iterable[StateCopy]], None],
    own_groups: set[int],
    stops: list[Collection[int]] | None = None,
    end_at_first_stop: bool = False,
) -> BurstTokens:
    """Run ``chunks`` (decodes, each ``1 + num_burst_tokens`` forwards) through ``graph``
    from ``batch``, the ForwardBatch of their known tokens. A chunk leaves the batch after
    its last forward, or after the forward that gave one of its ``stops`` (each chunk's
    stop token ids; none: none), which with ``end_at_first_stop`` ends the burst for all
    (module doc); its snapshots are copied from its live page after the forward that
    reaches their position."""
    assert batch.has_initial_state is not None
    widths = [1 + c.num_burst_tokens for c in chunks]
    steps = max(widths)
    any_stop = sorted(set().union(*stops)) if stops else []
    stop_ids = long_tensor(any_stop, batch.input_ids.device) if any_stop else None
    all_tables, all_pages = graph.plan.tables_and_pages(batch)
    tables, pages = all_tables, all_pages
    fresh = ~batch.has_initial_state
    ids, positions = batch.input_ids, batch.positions
    device = ids.device
    tokens = torch.empty(len(chunks), steps, dtype=torch.long, device=device)
    # each token's logit: a forward whose row is NaN or all -inf has no token to give,
    # found once at the end (max's index is argmax's, ties and NaN included)
    top_logits = torch.zeros(len(chunks), steps, device=device)
    due = snapshots_by_forward(chunks, manager, own_groups)
    rows = list(range(len(chunks)))
    index: Tensor | None = None  # the rows still running, where fewer than all
    for j in range(steps):
        still = [i for i in rows if widths[i] > j]
        if not still:  # every chunk stopped, or one ended the burst
            break
        if len(still) < len(rows):  # some chunks are done (j > 0): the rest go on alone
            rows = still
            index = long_tensor(rows, device)
            tables = [t[index] for t in all_tables]
            pages = [p[index] for p in all_pages]
            fresh = torch.zeros(len(rows), dtype=torch.bool, device=device)  # written now
            positions = batch.positions[index] + j
            ids = tokens[index, j - 1]
        logits = graph.run(ids, positions, tables, pages, fresh)
        top, chosen = logits.max(dim=-1)
        if index is None:
            tokens[:, j] = chosen
            top_logits[:, j] = top
        else:
            tokens[index, j] = chosen
            top_logits[index, j] = top
        copy_pages(due.get(j, ()))
        if stop_ids is not None:
            assert stops is not None
            _stop_at(j, chosen, stop_ids, rows, stops, widths, end_at_first_stop)
        ids, positions = chosen, positions + 1
        if j == 0:
            fresh = torch.zeros_like(fresh)  # every state has been written now
    return BurstTokens(tokens.tolist(), torch.isfinite(top_logits).tolist(), widths)


def _stop_at(
    j: int,
    chosen: Tensor,
    stop_ids: Tensor,
    rows: list[int],
    stops: list[Collection[int]],
    widths: list[int],
    end_at_first_stop: bool,
) -> None:
    """After forward ``j``: the chunks (``rows``, in the batch's order) whose token
    ``chosen`` is one of their own ``stops`` get no forward after it (their ``widths``
    cut to ``j + 1``), nor, with ``end_at_first_stop``, does any other. One ``isin`` a
    forward (``stop_ids``: every chunk's stop ids), rows looked at only on a hit."""
    hit = torch.isin(chosen, stop_ids)
    if not bool(hit.any()):
        return
    for r, token in zip(hit.nonzero()[:, 0].tolist(), chosen[hit].tolist(), strict=True):
        if token in stops[rows[r]]:
            widths[rows[r]] = min(widths[rows[r]], j + 1)
            if end_at_first_stop:
                widths[:] = [min(w, j + 1) for w in widths]
                return


def snapshot_copies(
    chunks: list[ScheduledChunk], manager: CacheManager, own_groups: set[int]
) -> Iterator[tuple[ScheduledChunk, int, StateCopy]]:
    """(chunk, position, the copy of its live page into the snapshot's page) for each
    snapshot of ``chunks`` in ``own_groups``: what a snapshot taken after a forward is
    (here after each forward of a burst; the runner's after a graph's last row)."""
    for chunk in chunks:
        for snap in chunk.allocation.snapshots:
            if snap.group_id in own_groups:
                live = manager.live_page(chunk.seq.seq_id, snap.group_id)
                yield chunk, snap.position, StateCopy(snap.group_id, live, snap.page)


def snapshots_by_forward(
    chunks: list[ScheduledChunk], manager: CacheManager, own_groups: set[int]
) -> dict[int, list[StateCopy]]:
    """Forward index j -> the snapshot copies due after it: a snapshot at ``position`` of
    a chunk from ``start`` holds the state after the forward of position - 1, the
    (position - 1 - start)-th (a one-token chunk's, all after forward 0)."""
    due: dict[int, list[StateCopy]] = {}
    for chunk, position, copy in snapshot_copies(chunks, manager, own_groups):
        due.setdefault(position - 1 - chunk.start, []).append(copy)
    return due
