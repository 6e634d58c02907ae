"""Short prefills' whole model step, embeddings to logits, as one package compiled ahead of time.

A chat's follow-up turn that hits the cache computes its new message and little else:
~100 tokens, where the eager forward of the tests' tiny Qwen3.5 runs ~600 ATen ops (the
chunked delta rule steps 16 tokens at a time, the attention plan, the captures, the norms),
~10 ms on this project's CPU, most of it dispatch, whatever the step's length. That fixed
cost was what kept a cached follow-up's first token from coming sooner (issue 12): the
uncached prompt it is compared with is ~5x longer but costs little more. This graph is the
prefill's counterpart of :mod:`hybridkv.models.decode_graph`, compiled the same way
(:func:`~hybridkv.models.decode_graph.load_graph_package`): a step whose chunks all are
decodes or prefills of at most :data:`MAX_TOKENS` tokens runs its decodes through the
decode graph and its prefills through this one, two calls in place of the eager forward.

Its batch is a rectangle: each prefill chunk a row of ``P`` tokens (the step's longest),
padded by repeating its last token. Padding is computed and thrown away, never kept: a
padded row's decay is 1 and its write strength 0 (the recurrent state passes through it
unchanged), the conv keeps the inputs up to the last real token, the attention masks
every key past a chunk's last real token and zeroes their values (a weight of 0 times a
never-written slot's NaN is NaN); the padded rows' K/V land in their chunk's last slot
(their hidden states differ from the last token's after the first GDN layer: its conv
window holds the repeated token), which the last real row's K/V then overwrite.

Its recurrence is the chunked (WY) form of :mod:`hybridkv.ops.gated_delta_rule.naive`
over one chunk of all ``P`` tokens (a 128 x 128 unit-triangular solve at most, where the
eager op steps 16 at a time: the same states to rounding; the solve is ATen's, called
through AOTInductor's proxy executor, as torch has no C shim for it), and its snapshots
are taken inside the forward, as the eager op's are: the state after row ``j`` is
``exp(cum_j) S + sum_{i <= j} exp(cum_j - cum_i) k_i v_new_i^T``, written to each
snapshot's page before the live state is (a step without a snapshot passes the last row
of its first chunk into its own live page, overwritten after). A snapshot at a chunk's
end is the live state, which the runner copies after the graph instead.

A step holding a longer chunk (a long fresh prompt), drafts or prompt log-probabilities
runs the eager forward over all its rows, as does one whose attention scores (requests x
query heads x ``P`` x the widest key table, fp32, one layer at a time) would pass
:data:`MAX_SCORES` (long contexts: the graph attends over whole tables at once).

It computes in the same roundings as the eager layers where that is cheap (the conv in fp32
rounded to the model dtype before the SiLU, the recurrence in fp32, the gated norm)
and keeps the attention's scores in fp32; the logits equal the eager forward's to rounding
(tests/models/test_prefill_graph.py, on a poisoned arena). Which models: those of the
decode graph's plan (:func:`~hybridkv.models.decode_graph.decode_graph_plan`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.gated_deltanet import GatedDeltaNet
from hybridkv.models import decode_graph
from hybridkv.models.base import CausalLM
from hybridkv.models.decode_graph import (
    GraphPlan,
    GraphStep,
    LayerPlan,
    attention_inputs,
    cache_inputs,
    decode_graph_plan,
    load_graph_package,
    through_layers,
)
from hybridkv.ops import ahead_of_time, gated_norm
from hybridkv.ops.ahead_of_time import AheadOfTimeStep
from hybridkv.ops.gated_delta_rule.chunk_operands import per_v_head
from hybridkv.ops.gated_delta_rule.mixer_decode import gates
from hybridkv.ops.gated_delta_rule.naive import l2norm
from hybridkv.ops.gated_norm import gated_rms_norm

# the longest prefill chunk the graph runs: its recurrence is one chunk of P tokens, whose
# unit-triangular system grows with P squared (the eager op's chunks are 16)
MAX_TOKENS = 128
# the most attention scores a layer of the graph holds at once (64 MiB of fp32); a step
# past it runs eagerly, where attention goes block by block
MAX_SCORES = 1 << 24
# the example the graph is exported on: requests, tokens a request, key pages, snapshots
# (torch specialises a size of one; the package runs any size, one included)
_EXAMPLE = (2, 3, 2, 2)


def _attention(
    mixer: PagedAttention,
    h: Tensor,
    positions: Tensor,
    last: Tensor,
    table: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
) -> Tensor:
    """One attention layer's output for the prefill rows ``h`` [R * P, H] at
    ``positions`` [R, P] (``last`` [R] the position of each row's last real token): the
    K/V written into their page slots, then causal attention over each request's keys."""
    cfg = mixer.cfg
    requests, width = positions.shape
    q, k, v, gate = attention_inputs(mixer, h, positions.flatten())
    block = key_cache.shape[1]
    page = table.gather(1, positions // block)  # [R, P]
    slot = positions % block
    k_rows = k.unflatten(0, (requests, width)).to(key_cache.dtype)  # [R, P, Hkv, D]
    v_rows = v.unflatten(0, (requests, width)).to(value_cache.dtype)
    key_cache[page, slot] = k_rows
    value_cache[page, slot] = v_rows
    # a padded row wrote its chunk's last slot too (other values: its hidden state is not
    # the last token's past the first GDN layer): the last real row's K/V written again
    end = (last - positions[:, 0])[:, None]  # [R, 1] the last real row of each request
    last_page, last_slot = page.gather(1, end)[:, 0], slot.gather(1, end)[:, 0]
    key_cache[last_page, last_slot] = k_rows.gather(
        1, end[..., None, None].expand(-1, 1, *k_rows.shape[2:])
    )[:, 0]
    value_cache[last_page, last_slot] = v_rows.gather(
        1, end[..., None, None].expand(-1, 1, *v_rows.shape[2:])
    )[:, 0]
    pages = table.clamp(min=0)  # -1 past a request's pages: masked below
    keys = key_cache[pages].flatten(1, 2).float().transpose(1, 2)  # [R, Hkv, L, D]
    values = value_cache[pages].flatten(1, 2).float().transpose(1, 2)
    length = keys.shape[2]
    key_at = torch.arange(length, device=h.device)
    # [R, Hkv, rep, P, D]: query head h = g * rep + i
    grouped = q.float().unflatten(0, (requests, width)).unflatten(2, (cfg.num_kv_heads, -1))
    grouped = grouped.permute(0, 2, 3, 1, 4)
    scores = grouped @ keys[:, :, None].transpose(-1, -2) * mixer.scale  # [R, Hkv, rep, P, L]
    allowed = key_at[None, None, :] <= positions[:, :, None]  # [R, P, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    written = key_at[None, :] <= last[:, None]  # [R, L]
    values = values.masked_fill(~written[:, None, :, None], 0.0)
    out = weights @ values[:, :, None]  # [R, Hkv, rep, P, Dv]
    out = out.permute(0, 3, 1, 2, 4).flatten(2).flatten(0, 1).to(h.dtype)  # [T, Hq * Dv]
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return mixer.o_proj(out)


def _conv(
    x: Tensor,
    lengths: Tensor,
    pages: Tensor,
    fresh: Tensor,
    conv_view: Tensor,
    taps: Tensor,
    capture_rows: Tensor,
    capture_pages: Tensor,
) -> Tensor:
    """The causal depthwise conv and SiLU of the rows ``x`` [R, P, C] after each request's
    carried inputs, rounded where the eager layer rounds (fp32 sums, the model dtype
    before the SiLU); the inputs up to each snapshot's row (``capture_rows`` into the
    flattened [R * P]) written to its page, then those up to each request's last real
    token (``lengths`` [R]) to its live page. ``taps`` [K, C] fp32, contiguous
    (:meth:`~hybridkv.models.decode_graph.GraphStep.conv_taps`)."""
    requests, width, _ = x.shape
    keep = conv_view.shape[2]
    carried = conv_view[pages].masked_fill(fresh[:, None, None], 0.0)  # [R, C, K-1]
    inputs = torch.cat([carried.transpose(1, 2), x.to(conv_view.dtype)], dim=1)  # [R, K-1+P, C]
    acc = x.float() * taps[keep]
    for tap in range(keep):
        acc = acc + inputs[:, tap : tap + width].float() * taps[tap]
    offsets = torch.arange(keep, device=x.device)
    # the K-1 inputs before row j + 1 of request r: inputs[r, j + 1 : j + K]
    flat_inputs = inputs.flatten(0, 1)  # [R * (K-1+P), C]
    capture_at = capture_rows // width * (width + keep) + capture_rows % width + 1
    conv_view[capture_pages] = flat_inputs[capture_at[:, None] + offsets].transpose(1, 2)
    live_at = torch.arange(requests, device=x.device) * (width + keep) + lengths
    conv_view[pages] = flat_inputs[live_at[:, None] + offsets].transpose(1, 2)
    return F.silu(acc.to(x.dtype))


def one_chunk_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunked gated delta rule over one chunk of all P rows, from ``state``.

    q (scaled), k [R, H, P, Dk], v [R, H, P, Dv], g (log decay), beta [R, H, P], state
    [R, H, Dk, Dv], all fp32. Returns (out [R, H, P, Dv], the state after the last row,
    and what a snapshot after row j needs: v_new [R, H, P, Dv], the decays
    ``exp(cum_j - cum_i)`` [R, H, P, P] (0 past j) and ``cum`` [R, H, P])."""
    rows = q.shape[2]
    cum = g.cumsum(-1)
    upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # the system S X = [v beta, k beta exp(cum)], S unit lower-triangular (S_ij = beta_i k_i
    # . k_j decay_ij, diagonal unread), solved transposed: X^T S^T = right^T, from S^T and
    # right^T made contiguous (56 systems of 48 x 48, 28 columns, one thread: 213 us
    # against 277 solved as S X = right; tests/models/test_prefill_graph.py checks it
    # against the recurrence one row at a time)
    system_t = (k @ k_beta.transpose(-1, -2)) * decay.transpose(-1, -2)
    right_t = torch.cat(
        [
            (v * beta[..., None]).transpose(-1, -2),
            (k_beta * cum.exp()[..., None]).transpose(-1, -2),
        ],
        dim=-2,
    )
    solved_t = torch.linalg.solve_triangular(
        system_t, right_t, upper=True, left=False, unitriangular=True
    )
    u, w = solved_t.transpose(-1, -2).split([v.shape[-1], k.shape[-1]], dim=-1)
    v_new = u - w @ state
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    end = cum[..., -1:]  # [R, H, 1]
    carried = (k * (end - cum).exp()[..., None]).transpose(-1, -2) @ v_new
    return out, state * end.exp()[..., None] + carried, v_new, decay, cum


def _gdn(
    mixer: GatedDeltaNet,
    h: Tensor,
    lengths: Tensor,
    pages: Tensor,
    fresh: Tensor,
    taps: Tensor,
    capture_rows: Tensor,
    capture_pages: Tensor,
    caches: tuple[Tensor, ...],
) -> Tensor:
    """One GDN layer's output for the prefill rows ``h`` [R * P, H], the states after each
    snapshot's row written to its page, then the states after each request's last real
    row to its live page (module doc)."""
    conv_view, ssm_view, ssm_source = caches
    requests = lengths.shape[0]
    width = h.shape[0] // requests
    heads, k_dim, v_dim = ssm_view.shape[1:]
    qkv, z, b, a = mixer.project(h)
    weights = mixer.mixer_weights()
    x = _conv(
        qkv.unflatten(0, (requests, width)),
        lengths,
        pages,
        fresh,
        conv_view,
        taps,
        capture_rows,
        capture_pages,
    ).flatten(0, 1)  # [T, C]
    key_dim = (x.shape[1] - heads * v_dim) // 2
    k_heads = key_dim // k_dim
    q = l2norm(x[:, :key_dim].unflatten(1, (k_heads, k_dim)).float()) * k_dim**-0.5
    k = l2norm(x[:, key_dim : 2 * key_dim].unflatten(1, (k_heads, k_dim)).float())
    v = x[:, 2 * key_dim :].unflatten(1, (heads, v_dim)).float()
    q, k = per_v_head(q, heads), per_v_head(k, heads)  # [T, Hv, Dk]
    g, beta = gates(a, b, weights.a_log, weights.dt_bias)
    real = (torch.arange(width, device=h.device)[None, :] < lengths[:, None]).flatten()
    g = g.masked_fill(~real[:, None], 0.0)  # a padded row: decay 1, write strength 0
    beta = beta.float().masked_fill(~real[:, None], 0.0)

    def heads_first(t: Tensor) -> Tensor:  # [T, Hv, ...] -> [R, Hv, P, ...]
        return t.unflatten(0, (requests, width)).transpose(1, 2)

    # the states read through their own alias, which inductor does not order against the
    # writes below: they feed the solve's products (w @ state), so they are a buffer read
    # before either write, and a step without snapshots may pass its first chunk's live
    # page as a capture (overwritten by the live write, which comes last)
    state = ssm_source[pages].float().masked_fill(fresh[:, None, None, None], 0.0)
    out, final, v_new, decay, cum = one_chunk_delta_rule(
        heads_first(q), heads_first(k), heads_first(v), heads_first(g), heads_first(beta), state
    )
    # each snapshot: the state after its row j of request r (module doc)
    r, j = capture_rows // width, capture_rows % width
    at_j = decay[r, :, j]  # [M, Hv, P]: exp(cum_j - cum_i), 0 past j
    k_j = heads_first(k)[r] * at_j[..., None]  # [M, Hv, P, Dk]
    captured = state[r] * cum[r, :, j].exp()[..., None, None] + k_j.transpose(-1, -2) @ v_new[r]
    ssm_view[capture_pages] = captured.to(ssm_view.dtype)
    ssm_view[pages] = final.to(ssm_view.dtype)
    o = out.transpose(1, 2).flatten(0, 1).to(h.dtype)  # [T, Hv, Dv]
    gated = gated_rms_norm(o, z, weights.norm, weights.norm_eps)
    return mixer.out_proj(gated.flatten(1))


class _Step(GraphStep):
    """The prefill forward the graph is traced from."""

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        lengths: Tensor,
        tables: tuple[Tensor, ...],
        pages: tuple[Tensor, ...],
        fresh: Tensor,
        captures: tuple[Tensor, ...],
        caches: tuple[Tensor, ...],
    ) -> Tensor:
        """[R, vocab] fp32 logits at each request's last real token (argument shapes:
        :meth:`PrefillGraph.run`)."""
        plan, model = self.plan, self.model
        table_of, pages_of = self.by_group(tables, pages)
        captures_of = {
            group: captures[2 * i : 2 * i + 2] for i, group in enumerate(plan.recurrent_groups)
        }
        requests, width = ids.shape
        last = positions[:, 0] + lengths - 1  # [R] the position of each last real token

        def mix(
            index: int,
            layer_plan: LayerPlan,
            mixer: nn.Module,
            h: Tensor,
            own: tuple[Tensor, ...],
        ) -> Tensor:
            group = layer_plan.group_id
            if layer_plan.kind == "attention":
                assert isinstance(mixer, PagedAttention)
                return _attention(mixer, h, positions, last, table_of[group], *own)
            assert isinstance(mixer, GatedDeltaNet)
            rows, snapshot_pages = captures_of[group]
            taps = self.conv_taps(index)
            return _gdn(mixer, h, lengths, pages_of[group], fresh, taps, rows, snapshot_pages, own)

        x = through_layers(model, plan, model.model.embed_tokens(ids.flatten()), caches, mix)
        last_rows = torch.arange(requests, device=ids.device) * width + lengths - 1
        return model.lm_head(x[last_rows]).float()


class PrefillGraph:
    """A loaded prefill graph: call :meth:`run` with a rectangle of prefill rows."""

    def __init__(
        self,
        step: AheadOfTimeStep,
        plan: GraphPlan,
        weights: list[Tensor],
        caches: list[Tensor],
        query_heads: int,
    ) -> None:
        self.step = step
        self.plan = plan
        self.weights = weights
        self.caches = caches
        self.query_heads = query_heads  # the most of any attention layer (0: none)
        kinds = [layer.kind for layer in plan.layers for _ in range(layer.num_caches)]
        # tokens a KV page holds (the first attention layer's; 0: no attention layer)
        self.block_tokens = next(
            (c.shape[1] for c, k in zip(caches, kinds, strict=True) if k == "attention"), 0
        )

    def width(self, batch: ForwardBatch) -> int | None:
        """The rectangle a batch of prefill chunks runs as: its longest chunk's tokens (2
        at least), or None where its attention scores would exceed :data:`MAX_SCORES`
        (module doc)."""
        starts = batch.query_start_loc
        width = max(2, int((starts[1:] - starts[:-1]).max()))
        if not self.query_heads:
            return width
        keys = max(t.shape[1] for t in batch.block_tables.values()) * self.block_tokens
        scores = batch.num_requests * self.query_heads * width * keys
        return width if scores <= MAX_SCORES else None

    def __call__(self, batch: ForwardBatch, width: int) -> Tensor:
        """[R, vocab] fp32 logits at the last token of each of the R prefill chunks of
        ``batch`` (each of at most :data:`MAX_TOKENS` tokens; its snapshots taken inside),
        run as a rectangle of ``width`` (:meth:`width`).

        The flat batch becomes the graph's rectangle: row ``r`` holds chunk ``r``'s tokens
        from its first, its last repeated past its end."""
        assert batch.has_initial_state is not None
        starts = batch.query_start_loc
        lengths = starts[1:] - starts[:-1]
        offsets = torch.arange(width, device=starts.device)
        index = starts[:-1, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
        captures: list[tuple[Tensor, Tensor]] = []
        for group in self.plan.recurrent_groups:
            wanted = batch.state_captures.get(group)
            if wanted is None or wanted.rows.numel() == 0:
                # none: the first chunk's last row into its own live page, which the live
                # state's write comes after (module doc)
                rows, pages = lengths[:1] - 1, batch.state_pages[group][:1]
            else:
                owner = torch.searchsorted(starts, wanted.rows, right=True) - 1
                rows = owner * width + wanted.rows - starts[owner]
                pages = wanted.pages
            captures.append((rows, pages))
        return self.run(
            batch.input_ids[index],
            batch.positions[index],
            lengths,
            *self.plan.tables_and_pages(batch),
            ~batch.has_initial_state,
            captures,
        )

    def run(
        self,
        ids: Tensor,
        positions: Tensor,
        lengths: Tensor,
        tables: Sequence[Tensor],
        pages: Sequence[Tensor],
        fresh: Tensor,
        captures: Sequence[tuple[Tensor, Tensor]],
    ) -> Tensor:
        """[R, vocab] fp32 logits at the last real token of each of R prefill chunks.

        ``ids``, ``positions`` [R, P] int64: each chunk's tokens and their positions,
        consecutive, padded to P by repeating the last (``lengths`` [R] the real ones,
        each at most :data:`MAX_TOKENS`); each attention group's block table [R, W] and
        each recurrent group's live page [R] (the plan's group order); ``fresh`` [R] bool
        (a state page that holds garbage: the chunk starts the request); per recurrent
        group, its snapshots as (rows into the flattened [R * P], pages) [M] each, M >= 1
        (a step without one passes a row of its own live page: module doc)."""
        flat_captures = [t for pair in captures for t in pair]
        flat = (*self.weights, ids, positions, lengths, *tables, *pages, fresh, *flat_captures)
        return self.step(*flat, *self.caches)[0]


# what the graph's code is made of (a change to one is a new package)
_SOURCES = (sys.modules[__name__], gated_norm, *decode_graph._SOURCES)


def load_prefill_graph(model: CausalLM, views: CacheViews) -> PrefillGraph | None:
    """The prefill graph of ``model`` over ``views``, loaded (built the first time on this
    machine, ~1-2 min), or None where the model, device or machine cannot run one."""
    if not ahead_of_time.available() or views.arena.device.type != "cpu":
        return None
    plan = decode_graph_plan(model, views)
    if plan is None:
        return None
    caches = cache_inputs(model, views, plan)
    device = views.arena.device
    requests, width, num_pages, snapshots = _EXAMPLE

    def longs(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.long, device=device)

    positions = torch.arange(width, device=device).repeat(requests, 1)
    tables = tuple(longs(requests, num_pages) for _ in plan.attention_groups)
    pages = tuple(torch.arange(requests, device=device) for _ in plan.recurrent_groups)
    captures = tuple(longs(snapshots) for _ in plan.recurrent_groups for _ in range(2))
    fresh = torch.ones(requests, dtype=torch.bool, device=device)
    lengths = torch.full((requests,), width, dtype=torch.long, device=device)
    inputs = (longs(requests, width), positions, lengths, tables, pages, fresh, captures)
    batch = torch.export.Dim("requests", min=1)
    tokens = torch.export.Dim("tokens", min=2, max=MAX_TOKENS)
    keys = torch.export.Dim("key_pages", min=1)
    snapshots_of = [torch.export.Dim(f"snapshots{g}", min=1) for g in plan.recurrent_groups]
    shapes = (
        {0: batch, 1: tokens},
        {0: batch, 1: tokens},
        {0: batch},
        tuple({0: batch, 1: keys} for _ in tables),
        tuple({0: batch} for _ in pages),
        {0: batch},
        tuple({0: snapshots_of[i // 2]} for i in range(len(captures))),
        tuple({0: torch.export.Dim(f"pages{i}", min=1)} for i in range(len(caches))),
    )
    loaded = load_graph_package(
        "prefill-graph",
        _Step(model, plan),
        model,
        plan,
        (*inputs, tuple(caches)),
        shapes,
        _SOURCES,
    )
    if loaded is None:
        return None
    heads = [m.cfg.num_heads for m in model.modules() if isinstance(m, PagedAttention)]
    return PrefillGraph(loaded[0], plan, loaded[1], caches, max(heads, default=0))
