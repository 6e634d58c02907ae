"""ModelRunner: the arena, the ForwardBatch of a step, and the state page copies.

The runner owns the one flat uint8 arena the CacheManager's layout describes, and turns a
scheduled step into the model's input: token ids and positions of every chunk, each
attention group's page table and each recurrent group's live state page. A prefix hit's
restore is a whole-page byte copy on the arena (snapshot -> the request's fresh live page)
before the forward. Snapshots are taken inside the forward (issue 12): each
``Allocation.snapshots`` entry (the state after exactly ``position`` tokens) becomes a
capture request to the group's recurrent ops (``ForwardBatch.state_captures``: the row of
the step's flat token axis after which the state is wanted, and the page to write it to),
so a snapshot inside a prefill chunk costs a copy, not a step of its own.

Where the model has them (loaded at warm-up), a step whose chunks all are decodes or
prefill chunks of at most :func:`prefill_graph_tokens` tokens runs no eager forward: its
decodes go through the decode graph (hybridkv.models.decode_graph), whose snapshots, each
after its request's one token, are the live state page copied whole once the graph has
run, and its prefill chunks through the prefill graph (hybridkv.models.prefill_graph),
which takes their snapshots inside them, those at a chunk's end again copies of the live
page after the graph (the prefill graph is loaded only beside a decode graph). Any other
step (a longer chunk, drafts, prompt log-probabilities, more attention scores than
``prefill_graph.MAX_SCORES``) runs the eager forward over all its rows.
A round of decode bursts (hybridkv.engine.decode_burst) runs its decodes through the
decode graph several times, and returns their tokens instead of logits.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hybridkv.core.ids import NULL_PAGE, ReqId
from hybridkv.core.layout import ArenaLayout
from hybridkv.core.manager import CacheManager, StateCopy
from hybridkv.core.spec import GroupSpec, ModelSpec
from hybridkv.engine.decode_burst import BurstTokens, run_burst, snapshot_copies
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.gated_deltanet import GatedDeltaNet
from hybridkv.models import prefill_graph
from hybridkv.models.base import CausalLM
from hybridkv.models.decode_graph import DecodeGraph, load_decode_graph
from hybridkv.models.prefill_graph import PrefillGraph, load_prefill_graph
from hybridkv.ops.compiled import compile_enabled
from hybridkv.ops.host_tensors import long_matrix, long_tensor
from hybridkv.ops.paged_state import StateCaptures
from hybridkv.sched.scheduler import ScheduledChunk


class StepLogits(NamedTuple):
    """A step's logits: each chunk's last row, and every row of the chunks that asked."""

    # [len(chunks) + drafts, vocab] fp32: the row after each chunk's last token (after a
    # speculative chunk's last token and each of its drafts: 1 + num_draft_tokens rows)
    last: Tensor
    rows: dict[int, Tensor]  # chunk index -> [chunk tokens, vocab] fp32, one row per token


def warm_up_compiled(model: nn.Module, views: CacheViews) -> None:
    """Compile ``model``'s compiled ops (hybridkv.ops.compiled) for the layout of its cache
    ``views`` before serving: each layer that has them implements
    ``warm_up_compiled(views)``. Otherwise the first decode step would wait for the compile
    (~2-8 s). The target's runner and a draft model each call it."""
    for module in model.modules():
        warm_up = getattr(module, "warm_up_compiled", None)
        if callable(warm_up):
            warm_up(views)


class ModelRunner:
    """Runs one scheduled step of the model over the paged arena."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        layout: ArenaLayout,
        device: torch.device,
        *,
        poison_arena: bool = False,
    ) -> None:
        """``poison_arena`` fills the arena with 0xFF (NaN in every float dtype), so that a
        read of a slot nobody wrote shows up in the logits; tests use it. Otherwise the arena
        is left uninitialised, like GPU memory, and untouched pages cost no host memory."""
        self.model = model
        self.spec = spec
        self.layout = layout
        self.device = device
        if poison_arena:
            arena = torch.full((layout.total_bytes,), 0xFF, dtype=torch.uint8, device=device)
        else:
            arena = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        self.views = CacheViews(spec, layout, arena)
        self.groups = [g for g in spec.groups if not g.is_draft]  # the draft runs elsewhere
        # the groups whose captures this runner writes (a draft model's: its proposer's)
        self.own_groups = {g.group_id for g in self.groups}
        self.num_page_copies = 0
        # the forward of one-token rows and of short prefill chunks, where the model has
        # them (loaded at warm-up; the prefill graph only beside a decode graph)
        self.decode_graph: DecodeGraph | None = None
        self.prefill_graph: PrefillGraph | None = None
        self._layer_heads = 1  # layer_heads(model), once the prefill graph loads
        self._prefill_graph_tokens = 0  # prefill_graph_tokens(model), likewise
        self._light_weights = True  # light_weights(model), likewise

    def warm_up_compiled(self) -> None:
        """Compile the model's compiled ops, and load its decode and prefill graphs, for
        this cache's layout before serving."""
        warm_up_compiled(self.model, self.views)
        if compile_enabled():
            self.decode_graph = load_decode_graph(self.model, self.views)
            if self.decode_graph is not None:
                self.prefill_graph = load_prefill_graph(self.model, self.views)
                self._layer_heads = layer_heads(self.model)
                self._prefill_graph_tokens = prefill_graph_tokens(self.model)
                self._light_weights = light_weights(self.model)

    @property
    def arena(self) -> Tensor:
        return self.views.arena

    def copy_pages(self, copies: Iterable[StateCopy]) -> None:
        """Byte-copy whole state pages; ``page_id * page_bytes`` is where a page starts.

        A group's copies go as one gather and scatter over the arena seen as its pages
        (64 snapshots of the tiny model's state: ~550 us one by one, mostly per-copy
        overhead; ~240 us at once), unless one of them writes a page another reads: then
        one by one, in order."""
        by_group: dict[int, list[StateCopy]] = {}
        for copy in copies:
            by_group.setdefault(copy.group_id, []).append(copy)
        for group_id, group_copies in by_group.items():
            size = self.layout.pages[group_id].page_bytes
            sources = [c.src_page for c in group_copies]
            targets = [c.dst_page for c in group_copies]
            self.num_page_copies += len(group_copies)
            if len(group_copies) == 1 or not set(targets).isdisjoint(sources):
                for src, dst in zip(sources, targets, strict=True):
                    self.arena[dst * size : (dst + 1) * size].copy_(
                        self.arena[src * size : (src + 1) * size]
                    )
                continue
            pages = self.arena[: self.arena.numel() // size * size].view(-1, size)
            if size % 8 == 0:  # whole words: ATen moves bytes one at a time
                pages = pages.view(torch.int64)
            rows = pages.index_select(0, long_tensor(sources, self.device))
            pages.index_copy_(0, long_tensor(targets, self.device), rows)

    def build_batch(
        self,
        chunks: list[ScheduledChunk],
        manager: CacheManager,
        all_rows: Collection[int] = (),
        *,
        final_states_copied: bool = False,
    ) -> ForwardBatch:
        """The forward's input for ``chunks``: logits rows at each chunk's last token (every
        token of the chunks in ``all_rows``), and a capture for each snapshot, except, with
        ``final_states_copied``, those after a chunk's last token: the caller copies the
        live page into them after the forward (:meth:`_copy_final_snapshots`; the graphs)."""
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        computed: list[int] = []
        for chunk in chunks:  # a burst's chunk: its one known token (decode_burst)
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.end - chunk.num_burst_tokens)
            starts.append(len(ids))
            computed.append(chunk.start)
        seq_ids = [c.seq.seq_id for c in chunks]
        tables, states = page_tables(self.groups, seq_ids, manager, self.device)

        def tensor(values: list[int]) -> Tensor:
            return long_tensor(values, self.device)

        logits_rows: list[int] = []
        for i, chunk in enumerate(chunks):  # every row of the chunks in all_rows, else the
            width = chunk.num_tokens if i in all_rows else 1 + chunk.num_draft_tokens  # last
            logits_rows += range(starts[i + 1] - width, starts[i + 1])
        return ForwardBatch(
            input_ids=tensor(ids),
            positions=tensor(positions),
            query_start_loc=tensor(starts),
            num_computed_tokens=tensor(computed),
            block_tables=tables,
            state_pages=states,
            logits_indices=tensor(logits_rows),
            state_captures=self._state_captures(chunks, starts, final_states_copied),
        )

    def _state_captures(
        self, chunks: list[ScheduledChunk], starts: list[int], final_states_copied: bool
    ) -> dict[int, StateCaptures]:
        """Each snapshot of the step, and each scratch state of a speculative chunk, as a
        capture of its group: the state after exactly ``position`` tokens is the state
        after the row of token ``position - 1``. Several per request and step are fine
        (every checkpoint inside a prefill chunk; the state after each draft, of which
        ``CacheManager.commit`` keeps one, and drops a snapshot past the kept tokens)."""
        wanted: dict[int, tuple[list[int], list[int]]] = {}
        for chunk, first_row in zip(chunks, starts, strict=False):
            if chunk.num_burst_tokens:  # copied after the burst's forwards (decode_burst)
                continue
            for snap in (*chunk.allocation.snapshots, *chunk.allocation.scratch):
                if snap.group_id not in self.own_groups:
                    continue
                if final_states_copied and snap.position == chunk.end:
                    continue
                assert chunk.start < snap.position <= chunk.end, (snap, chunk)
                rows, pages = wanted.setdefault(snap.group_id, ([], []))
                rows.append(first_row + snap.position - 1 - chunk.start)
                pages.append(snap.page)
        return {
            gid: StateCaptures(
                long_tensor(rows, self.device),
                long_tensor(pages, self.device),
            )
            for gid, (rows, pages) in wanted.items()
        }

    @property
    def bursts(self) -> bool:
        """Whether decode bursts can run now: the decode graph is loaded and on."""
        return self.decode_graph is not None and compile_enabled()

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], manager: CacheManager, all_rows: Collection[int] = ()
    ) -> StepLogits:
        """Run the step: logits at each chunk's last token (a speculative chunk: its last
        token and every draft, ``1 + num_draft_tokens`` rows in order), and at every token
        of the chunks in ``all_rows`` (prompt log-probabilities need them).

        Inference mode, not just no_grad: no view or version-counter tracking per op, which
        made a batch-8 decode step of the small Qwen3-Next 16.1-16.9 -> 14.9-15.0 ms (2
        interleaved pairs; ~2,300 ops a step, so per-op overhead is most of it)."""
        self.copy_pages(c for chunk in chunks for c in chunk.allocation.restores)
        logits = None if all_rows else self._run_graphs(chunks, manager)
        if logits is not None:
            return StepLogits(logits, {})
        # [selected rows, vocab]; the forward also writes the snapshots (state captures)
        logits = self.model(self.build_batch(chunks, manager, all_rows), self.views).float()
        if not all_rows:
            return StepLogits(logits, {})
        last: list[int] = []
        rows: dict[int, Tensor] = {}
        at = 0
        for i, chunk in enumerate(chunks):
            verified = 1 + chunk.num_draft_tokens
            width = chunk.num_tokens if i in all_rows else verified
            if i in all_rows:
                rows[i] = logits[at : at + width]
            last += range(at + width - verified, at + width)
            at += width
        return StepLogits(logits[last], rows)

    @torch.inference_mode()
    def execute_burst(
        self,
        chunks: list[ScheduledChunk],
        manager: CacheManager,
        stops: list[Collection[int]] | None = None,
        end_at_first_stop: bool = False,
    ) -> BurstTokens:
        """Run a round of decode bursts (its chunks all decodes, some with
        ``num_burst_tokens``) through the decode graph: the tokens of all its forwards
        (each chunk's up to one of its ``stops``: :func:`decode_burst.run_burst`)."""
        assert self.decode_graph is not None and self.bursts, "bursts need the decode graph"
        assert all(c.known_end - c.start == 1 and _unspeculated(c) for c in chunks), chunks
        batch = self.build_batch(chunks, manager)
        return run_burst(
            self.decode_graph,
            batch,
            chunks,
            manager,
            self.copy_pages,
            self.own_groups,
            stops,
            end_at_first_stop,
        )

    def _run_graphs(self, chunks: list[ScheduledChunk], manager: CacheManager) -> Tensor | None:
        """The step's logits [chunks, vocab] from the model's graphs (module doc), or None
        where one of its chunks needs the eager forward (or compiling is off)."""
        graph = self.decode_graph if compile_enabled() else None
        if graph is None:
            return None
        decodes: list[int] = []
        prefills: list[int] = []
        for i, chunk in enumerate(chunks):
            if _one_token(chunk):
                decodes.append(i)
            elif self.prefill_graph is not None and self._takes_prefill(chunk):
                prefills.append(i)
            else:
                return None
        if not prefills:  # a decode step
            return self._decode_through(graph, chunks, manager)
        from_prefills = self._prefill_through([chunks[i] for i in prefills], manager)
        if from_prefills is None:  # their attention scores too many
            return None
        if not decodes:
            return from_prefills
        from_decodes = self._decode_through(graph, [chunks[i] for i in decodes], manager)
        logits = from_prefills.new_empty(len(chunks), from_prefills.shape[1])
        logits[long_tensor(prefills, self.device)] = from_prefills
        logits[long_tensor(decodes, self.device)] = from_decodes
        return logits

    def _takes_prefill(self, chunk: ScheduledChunk) -> bool:
        """Whether the prefill graph may run ``chunk``: at most
        :func:`prefill_graph_tokens` tokens, no drafts or scratch states, and, for a model
        past :data:`LIGHT_WEIGHT_BYTES`, at most :data:`HEAVY_PREFILL_MAX_KEYS` tokens of
        context (its attention over whole key tables costs more than the eager one's)."""
        if chunk.num_tokens > self._prefill_graph_tokens or not _unspeculated(chunk):
            return False
        return self._light_weights or chunk.end <= HEAVY_PREFILL_MAX_KEYS

    def _prefill_through(
        self, chunks: list[ScheduledChunk], manager: CacheManager
    ) -> Tensor | None:
        """[chunks, vocab] logits of short prefill chunks from the prefill graph, in groups
        of requests whose intermediates fit in the L2 (:func:`prefill_graph_calls`), their
        end snapshots copied after it; None (nothing run) where a group's attention scores
        would be too many."""
        graph = self.prefill_graph
        assert graph is not None
        block = graph.block_tokens or 1
        sizes = [(c.num_tokens, -(-c.end // block) * block) for c in chunks]
        calls: list[tuple[ForwardBatch, int]] = []
        heads = self._layer_heads
        groups = prefill_graph_calls(sizes, heads) if self._light_weights else [range(len(chunks))]
        for group in groups:
            batch = self.build_batch([chunks[i] for i in group], manager, final_states_copied=True)
            width = graph.width(batch)
            if width is None:
                return None
            calls.append((batch, width))
        logits = [graph(batch, width) for batch, width in calls]
        self._copy_final_snapshots(chunks, manager)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _decode_through(
        self, graph: DecodeGraph, chunks: list[ScheduledChunk], manager: CacheManager
    ) -> Tensor:
        """[chunks, vocab] logits of one-token chunks from the decode graph, their
        snapshots copied after it."""
        logits = graph(self.build_batch(chunks, manager, final_states_copied=True))
        self._copy_final_snapshots(chunks, manager)
        return logits

    def _copy_final_snapshots(self, chunks: list[ScheduledChunk], manager: CacheManager) -> None:
        """The snapshots after the last token of ``chunks``, which a graph has just run: the
        live state page, which holds that state now, copied whole into each snapshot's page.
        A decode's snapshots all are such. A prefill chunk's at its end would otherwise be
        a capture inside the prefill graph: ~60 us each for the tiny model's two GDN
        layers, where a copy is ~4 us (64 at once); and a copy is the live state's bytes
        exactly."""
        self.copy_pages(
            copy
            for chunk, position, copy in snapshot_copies(chunks, manager, self.own_groups)
            if position == chunk.end
        )


# The most bytes of one layer's largest intermediates (the delta rule's [R, Hv, P, P] decays
# and systems, the attention's [R, Hq, P, L] scores, fp32) one call of the prefill graph
# computes: a step's prefill chunks run in groups of requests whose intermediates fit in a
# core's L2 (512 KiB on this project's CPU) instead of streaming through memory stage by
# stage. 64 x 48 prompt tokens of the tiny Qwen3.5 (~37 KB a request): 64.7 ms in one call,
# 59.8 in calls of 32, 56.7 of 16, 55.2 of 8 (medians of 40 interleaved).
PREFILL_GROUP_BYTES = 1 << 19


# A model whose weights pass this many bytes is bound by arithmetic more than by dispatch:
# the prefill graph runs its step's chunks in one call (each call reads every weight, which
# the L2-sized groups' smaller intermediates cannot repay), and only chunks of short
# contexts (the graph attends over whole key tables, gathered in fp32). The small
# Qwen3-Next of vs_vllm_engine.py (84 MB of bf16 weights), W3's 32 chunks of 14 tokens
# over 1,536 keys: 480 ms one chunk a call (each one's scores pass the group budget), 339
# ms in one call, 174-181 ms eagerly (2026-11-27, one process each). The tiny Qwen3.5's
# weights are ~0.3 MB.
LIGHT_WEIGHT_BYTES = 16 << 20
HEAVY_PREFILL_MAX_KEYS = 256


def light_weights(model: nn.Module) -> bool:
    """Whether ``model``'s weights are within :data:`LIGHT_WEIGHT_BYTES`."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) <= LIGHT_WEIGHT_BYTES


def prefill_graph_calls(sizes: list[tuple[int, int]], heads: int) -> list[range]:
    """The calls of the prefill graph for chunks of ``sizes`` (tokens, keys: its table's
    slots) in order: consecutive groups whose intermediates, requests x ``heads`` (the
    most of a layer, :func:`layer_heads`) x the group's longest chunk x max(that, its most
    keys) x 4 bytes, stay within :data:`PREFILL_GROUP_BYTES` (a chunk alone may pass it).
    Each chunk counts at its own size: one long chunk does not shrink the others' groups."""
    groups: list[range] = []
    start = width = keys = 0
    for i, (tokens, chunk_keys) in enumerate(sizes):
        w, k = max(width, tokens), max(keys, chunk_keys)
        if i > start and 4 * max(1, heads) * (i + 1 - start) * w * max(w, k) > PREFILL_GROUP_BYTES:
            groups.append(range(start, i))
            start, w, k = i, tokens, chunk_keys
        width, keys = w, k
    groups.append(range(start, len(sizes)))
    return groups


def layer_heads(model: nn.Module) -> int:
    """The most heads of any layer of ``model``: attention's query heads, GDN's value
    heads (what sizes a prefill request's intermediates in the graph)."""
    heads = [m.cfg.num_heads for m in model.modules() if isinstance(m, PagedAttention)]
    heads += [m.cfg.num_v_heads for m in model.modules() if isinstance(m, GatedDeltaNet)]
    return max(heads, default=1)


def _unspeculated(chunk: ScheduledChunk) -> bool:
    """Whether a chunk has no drafts or scratch states (what neither graph runs)."""
    return chunk.num_draft_tokens == 0 and not chunk.allocation.scratch


def _one_token(chunk: ScheduledChunk) -> bool:
    """Whether a chunk may run the decode graph: one token, no drafts or scratch states."""
    return chunk.num_tokens == 1 and _unspeculated(chunk)


# The most multiply-adds a GDN layer of the prefill graph spends per row and row of its
# chunk beyond the eager chunked form: its recurrence is one chunk of all P rows, whose
# P x P products (the system, its solve, q k^T and their uses) cost each row ~P x Hv x
# (Dk + Dv) where the eager op's 16-row chunks cost ~16 x that. The tiny Qwen3.5 (Hv x
# (Dk + Dv) = 112), bound by dispatch, gains at any P up to 128; the small Qwen3-Next of
# vs_vllm_engine.py (1,024), bound by arithmetic, ran 32 x 128-token chunks 1.43x slower
# than eagerly, 32 x 64 1.05x, 8 x 64 0.92x, one 100-token chunk 0.84x (one process,
# alternated, 2026-11-27 evening): 64 tokens is its crossover.
PREFILL_ROW_BUDGET = 1 << 16


def prefill_graph_tokens(model: nn.Module) -> int:
    """The longest prefill chunk the prefill graph runs for ``model``: at most
    ``prefill_graph.MAX_TOKENS``, and :data:`PREFILL_ROW_BUDGET` over its widest GDN
    layer's Hv x (Dk + Dv) (longer chunks cost more there than the eager forward)."""
    widths = [
        m.cfg.num_v_heads * (m.cfg.k_head_dim + m.cfg.v_head_dim)
        for m in model.modules()
        if isinstance(m, GatedDeltaNet)
    ]
    widest = max(widths, default=0)
    if not widest:
        return prefill_graph.MAX_TOKENS
    return max(1, min(prefill_graph.MAX_TOKENS, PREFILL_ROW_BUDGET // widest))


def page_tables(
    groups: Iterable[GroupSpec], seq_ids: list[ReqId], manager: CacheManager, device: torch.device
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """(block table per attention group, live state page per recurrent group) of ``seq_ids``."""
    tables: dict[int, Tensor] = {}
    states: dict[int, Tensor] = {}
    for group in groups:
        gid = group.group_id
        if group.is_recurrent:
            pages = [manager.live_page(seq_id, gid) for seq_id in seq_ids]
            states[gid] = long_tensor(pages, device)
            continue
        rows = [manager.block_table(seq_id, gid) for seq_id in seq_ids]
        width = max(len(r) for r in rows)
        padded = (r if len(r) == width else [*r, *[NULL_PAGE] * (width - len(r))] for r in rows)
        tables[gid] = long_matrix(padded, width, device)
    return tables, states
