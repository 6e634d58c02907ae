"""Mixture of experts as grouped matmuls over the tokens sorted by expert.

Every MoE family here (Qwen3-Next / Qwen3.5-MoE, Jamba, LFM2-MoE, GraniteMoeHybrid, NemotronH)
routes each token to k experts by its own rule, then computes the same sum::

    out[t] = sum_j  w[t, j] * expert_{e[t, j]}(x[t])          j = 0 .. k-1

The T*k (token, expert) pairs are sorted by expert once per layer (:class:`ExpertRouting`),
so each expert's rows are one contiguous slice and every weight of all experts is one
grouped matmul (:class:`GroupedExperts`, ``F.grouped_mm`` over weights stacked [E, out, in])
instead of a Python loop with a mask per expert. The sum over j adds each token's terms in
ascending expert order, starting from the first, which is the order the former loop over
experts accumulated them in, so the result is bit-identical to it (tests/layers/test_moe.py).

Small batches (decode steps: a few rows per expert) take a padded layout instead: each
expert's rows in a slot of ``capacity`` rows (the largest group), zeros in the unused rows,
and one ``torch.bmm`` per weight over [E, capacity, in]. On CPU ``F.grouped_mm`` pays a
fixed cost per expert that one batched call does not: 8 experts, 512 -> 512 bf16, best of
30 on 1 thread: 4 rows each 192 us (bmm) vs 316 us (grouped), 21 rows 498 vs 627 us, 64
rows 1309 vs 1440 us. Padding costs rows, so the padded layout is used up to 64 rows per
expert and at most 3 slots per real row (one token, top-2 of 8, stays grouped). The padded
products are bit-identical to per-expert ``F.linear`` in bf16 and fp16 (oneDNN's reduced-
precision rows are independent of the row count), not in fp32 (MKL picks its kernel by the
row count), so fp32 keeps the grouped path (tests/layers/test_moe.py checks both). The
padded layout is found without sorting (:class:`PaddedRouting`: a running count per
expert) and keeps the pairs in token order, so its decode needs no sort, no sorted copy of
the routing weights and no gather to combine: a MoE layer of the small Qwen3-Next (8
experts 512 -> 256, shared expert 512), one thread, median of 5 interleaved runs, 8 rows
759 -> 718 us, 64 rows 1,323 -> 1,250 us.

On the CPU the engine packs each expert's weights once for oneDNN instead
(:meth:`GroupedExperts.pack_weights`, called by ``pack_linears`` at load): then each
expert with rows runs its two products as packed linears, one call each. 8 experts of
512 -> 512 | 256 -> 512, one thread, weights cold in cache as in a decode step, median of
30: 1 token 270 -> 153 us, 8 tokens 509 -> 452 us, 64 tokens 819 -> 748 us; hot, 4096
tokens (a prefill step) 28 -> 15 ms in bf16 and 80 -> 29 ms in fp32. Products stay
bit-identical to ``F.linear`` in bf16. A compiled graph runs packed experts as one call
per weight of all experts (``packed_grouped_linear``, the weights named by handle), the
gated activation between the two calls compiled with the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.layers.mlp import GatedMLP, activation
from hybridkv.layers.packed_linear import PackedLinear, packed_grouped_linear, packing_threshold
from hybridkv.ops.row_copy import select_rows

_GROUPED_MM_ALIGN_BYTES = 16  # F.grouped_mm needs 16-byte row strides on CPU
PADDED_MAX_CAPACITY = 64  # padded bmm up to this many rows per expert (measured crossover ~75)
PADDED_MAX_WASTE = 3  # ... and at most this many padded rows per real row (T=1 top-2 of 8: 4)
_PADDED_DTYPES = (torch.bfloat16, torch.float16)  # where bmm rows equal F.linear's bit for bit


class ExpertRouting:
    """One layer's routing laid out for grouped matmuls.

    Row ``i`` of the sorted layout is the flat pair ``order[i] = t * k + j`` (token ``t``,
    its ``j``-th expert); rows are grouped by expert, ascending, and by token inside one.

    Args:
        experts: [T, k] int64 expert ids, distinct within a row.
        num_experts: E.
    """

    def __init__(self, experts: Tensor, num_experts: int) -> None:
        num_tokens, top_k = experts.shape
        self.num_experts = num_experts
        flat = experts.reshape(-1)  # [T*k]
        self.order = torch.argsort(flat, stable=True)  # [N] sorted row -> flat pair
        self.token = self.order.div(top_k, rounding_mode="floor")  # [N] token of each row
        # [E] rows of each expert; a scatter, not bincount, whose size depends on the ids'
        # values (the graphs trace this with their sizes static: models/decode_graph.py)
        self.counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        self.offsets = self.counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(self.order.numel(), device=flat.device)
        by_expert = experts.argsort(dim=1)  # [T, k] each token's slots, ascending expert
        self.combine_rows = rank.view(num_tokens, top_k).gather(1, by_expert)  # [T, k]

    @property
    def num_rows(self) -> int:
        return int(self.order.numel())

    def sort(self, x: Tensor) -> Tensor:
        """[T, H] -> [N, H]: each row's token input, in expert order (rows moved as 16-byte
        words: ``index_select`` costs per element)."""
        return select_rows(x, self.token)

    def sort_weights(self, weights: Tensor) -> Tensor:
        """[T, k] -> [N, 1] routing weight of each sorted row."""
        return weights.reshape(-1).index_select(0, self.order)[:, None]

    def combine(self, rows: Tensor) -> Tensor:
        """[N, H] weighted expert outputs -> [T, H], each token's k terms summed in
        ascending expert order (the former loop's ``index_add_`` order)."""
        num_tokens, top_k = self.combine_rows.shape
        # [T, k, H], rows moved as 16-byte words: advanced indexing copied per element
        # (a 4,096-token prefill of the small Qwen3-Next: 4.4 ms a layer)
        terms = select_rows(rows, self.combine_rows.view(-1))
        terms = terms.view(num_tokens, top_k, rows.shape[-1])  # (no -1: zero tokens)
        out = terms[:, 0]
        for j in range(1, terms.shape[1]):
            out = out + terms[:, j]
        return out


def pads_well(capacity: int, num_rows: int, num_experts: int) -> bool:
    """Whether the padded layout is the faster one (module doc): every group within
    :data:`PADDED_MAX_CAPACITY` rows and at most :data:`PADDED_MAX_WASTE` slots per row."""
    fits = 0 < capacity <= PADDED_MAX_CAPACITY
    return fits and num_experts * capacity <= PADDED_MAX_WASTE * num_rows


class PaddedRouting:
    """A decode-sized batch's (token, expert) pairs in the padded layout: expert ``e``'s
    pairs, in token order, fill slots ``e * capacity ..`` of ``[E * capacity]`` rows.

    Pair ``i = t * k + j`` (token ``t``, its ``j``-th expert) goes to slot ``e * capacity +
    r``, ``r`` the number of earlier pairs of its expert: a running count per expert (one-hot
    rows summed down the pairs), so the layout needs no sort and the outputs come back in
    pair order, where each token's terms are adjacent. The slots are those of the sorted
    layout (:class:`ExpertRouting`), so the products are the same bits; it takes ~10 ops
    where sorting, padding and combining through the sorted layout took ~30 per MoE layer
    (a decode step of the small Qwen3-Next has eight).

    Args:
        experts: [T, k] int64 expert ids, distinct within a row.
        num_experts: E.
    """

    def __init__(self, experts: Tensor, num_experts: int) -> None:
        flat = experts.reshape(-1)  # [N]
        seen = F.one_hot(flat, num_experts).cumsum(0)  # [N, E] pairs of each expert so far
        self.num_experts = num_experts
        self.num_rows = int(flat.numel())
        self.capacity = int(seen[-1].max())  # the largest group (a host sync)
        rank = seen.gather(1, flat[:, None]).squeeze(1) - 1  # [N] rank within its expert
        self.slots = flat * self.capacity + rank  # [N]

    @staticmethod
    def for_batch(experts: Tensor, num_experts: int) -> PaddedRouting | None:
        """The layout when it pads well (:func:`pads_well`), else None. Batches that cannot
        (one token: a slot per expert for k rows; more rows than the largest capacity
        allows) are told apart before any op runs."""
        num_rows = experts.numel()
        if num_experts > PADDED_MAX_WASTE * num_rows:  # capacity >= 1
            return None
        if num_rows > num_experts * PADDED_MAX_CAPACITY:  # capacity >= num_rows / E
            return None
        routing = PaddedRouting(experts, num_experts)
        return routing if pads_well(routing.capacity, routing.num_rows, num_experts) else None


def combine_pairs(rows: Tensor, experts: Tensor) -> Tensor:
    """[N, H] weighted terms in pair order (``t * k + j``) -> [T, H]: each token's k terms
    summed in ascending expert order, as :meth:`ExpertRouting.combine` (for k <= 2 any
    order: two terms add to the same bits either way)."""
    num_tokens, top_k = experts.shape
    terms = rows.view(num_tokens, top_k, -1)
    if top_k > 2:
        by_expert = experts.argsort(dim=1)[..., None].expand(terms.shape)
        terms = terms.gather(1, by_expert)
    out = terms[:, 0]
    for j in range(1, top_k):
        out = out + terms[:, j]
    return out


def grouped_mm_aligned(weight: Tensor) -> bool:
    """Whether a stacked expert weight [E, out, in] takes ``F.grouped_mm``: every row
    stride a multiple of 16 bytes (else the per-expert loop, whose slices depend on
    values, so no graph can trace it)."""
    size = weight.element_size()
    return all(n * size % _GROUPED_MM_ALIGN_BYTES == 0 for n in weight.shape[1:])


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, bias: Tensor | None) -> Tensor:
    """``x[rows of e] @ weight[e].T (+ bias[e])`` for every expert e: [N, in] -> [N, out].

    One ``F.grouped_mm`` when it can run (no bias, no autograd, 16-byte row strides);
    otherwise one ``F.linear`` per expert slice, the same products.
    """
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if bias is None and grouped_mm_aligned(weight) and not grad and x.dtype == weight.dtype:
        return F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets)
    ends = offsets.tolist()
    parts = []
    for e, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if hi > lo:
            parts.append(F.linear(x[lo:hi], weight[e], None if bias is None else bias[e]))
    if not parts:
        return x.new_empty(0, weight.shape[1])
    return torch.cat(parts)


class GroupedExperts(nn.Module):
    """E feed-forward experts with stacked weights, run over rows sorted by expert.

    ``gate_up_proj`` [E, 2I, H] holds ``[gate | up]`` per expert (transformers 5 keeps its
    experts this way in memory), or [E, I, H] ``up`` alone when ``gated`` is False
    (NemotronH's ``down(relu(up(x))^2)``); ``down_proj`` [E, H, I]. Checkpoints that store
    one module per expert load through :meth:`checkpoint_views`.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: Callable[[Tensor], Tensor],
        *,
        gated: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gated = gated
        self.intermediate = intermediate
        self.act = act
        self._num_experts = num_experts
        # per expert (gate_up, down) packed for oneDNN once pack_weights ran, else None
        self.packed: nn.ModuleList | None = None
        # the weights' dtype once upcast_weights ran (fp32 products of a bf16 / fp16
        # model on a CPU that emulates its dtype), else None: the input's dtype
        self.matmul_dtype: torch.dtype | None = None
        width = (2 if gated else 1) * intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, width))
            self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    @property
    def num_experts(self) -> int:
        return self._num_experts

    def pack_weights(self, min_elements: int | None = None) -> int:
        """Pack every expert's weights for oneDNN in place of the stacked parameters
        (CPU inference; see the module doc). Skipped when the stacked ``gate_up_proj``
        has fewer elements than ``min_elements`` (default: the packing threshold of its
        dtype) or oneDNN cannot pack its dtype here. Returns the number of weights packed."""
        if self.packed is not None:
            return 0
        threshold = packing_threshold(self.gate_up_proj.dtype, min_elements)
        if threshold is None or self.gate_up_proj.numel() < threshold:
            return 0
        experts = []
        for e in range(self.num_experts):
            gate_up = PackedLinear.from_weight(
                self.gate_up_proj[e], None if self.gate_up_bias is None else self.gate_up_bias[e]
            )
            down = PackedLinear.from_weight(
                self.down_proj[e], None if self.down_bias is None else self.down_bias[e]
            )
            if gate_up is None or down is None:
                return 0
            experts.append(nn.ModuleList([gate_up, down]))
        self.packed = nn.ModuleList(experts)
        for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
            setattr(self, name, None)  # the packed copies replace them
        return 2 * self.num_experts

    def upcast_weights(self) -> int:
        """Hold the weights in fp32, each product run in fp32 and rounded back to the
        input's dtype, as :class:`~hybridkv.layers.fp32_matmul.Fp32Linear` does (CPU
        inference where the model dtype is emulated; call before :meth:`pack_weights`).
        Returns the number of weights converted (0: already fp32, or packed)."""
        if self.packed is not None or self.gate_up_proj.dtype not in _PADDED_DTYPES:
            return 0
        for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
            param = getattr(self, name)
            if param is not None:
                setattr(self, name, nn.Parameter(param.detach().float(), requires_grad=False))
        self.matmul_dtype = torch.float32
        return 2

    def forward(self, x: Tensor, routing: ExpertRouting) -> Tensor:
        """x [N, H] rows in expert order -> [N, H]."""
        if self.packed is not None:
            if torch.compiler.is_compiling():  # a graph: the weights by handle
                return self._packed_grouped(x, routing.offsets)
            return self._per_expert(x, routing.offsets.tolist(), self.packed)
        h = self._grouped(x, self.gate_up_proj, routing.offsets, self.gate_up_bias)
        return self._grouped(self._activate(h), self.down_proj, routing.offsets, self.down_bias)

    def _grouped(self, x: Tensor, weight: Tensor, offsets: Tensor, bias: Tensor | None) -> Tensor:
        """:func:`grouped_linear`, in :attr:`matmul_dtype` if set, rounded to x's dtype."""
        if self.matmul_dtype is None:
            return grouped_linear(x, weight, offsets, bias)
        return grouped_linear(x.to(self.matmul_dtype), weight, offsets, bias).to(x.dtype)

    def _activate(self, h: Tensor) -> Tensor:
        if self.gated:
            gate, up = h.split(self.intermediate, dim=-1)
            return self.act(gate) * up  # [..., I]
        return self.act(h)

    def _packed_grouped(self, x: Tensor, ends: Tensor) -> Tensor:
        """:meth:`_per_expert` as a graph computes it: each weight one call of the packed
        grouped product, the activation between them in the graph."""
        assert self.packed is not None
        dtype = self.matmul_dtype or x.dtype
        gate_up, down = (torch.stack([pair[i].handle for pair in self.packed]) for i in (0, 1))
        width, hidden = self.packed[0][0].out_features, self.packed[0][1].out_features
        h = packed_grouped_linear(x.to(dtype), ends, gate_up, width).to(x.dtype)
        return packed_grouped_linear(self._activate(h).to(dtype), ends, down, hidden)

    def _per_expert(self, x: Tensor, ends: list[int], packed: nn.ModuleList) -> Tensor:
        """Each expert with rows runs its packed linears on its slice of the sorted rows."""
        out = x.new_empty(x.shape[0], packed[0][1].out_features)
        dtype = self.matmul_dtype or x.dtype
        start = 0
        for (gate_up, down), end in zip(packed, ends, strict=True):
            if end > start:
                h = gate_up(x[start:end].to(dtype)).to(x.dtype)
                out[start:end] = down(self._activate(h).to(dtype))
            start = end
        return out

    def padded_routing(self, x: Tensor, experts: Tensor) -> PaddedRouting | None:
        """The padded layout for ``x`` [T, H] routed to ``experts`` [T, k], or None where
        the sorted layout runs: packed or fp32 weights, biases, autograd, or a batch that
        pads badly (module doc)."""
        if not self._padded_ok(x):
            return None
        return PaddedRouting.for_batch(experts, self.num_experts)

    def _padded_ok(self, x: Tensor) -> bool:
        if self.gate_up_proj is None:  # packed
            return False
        grad = torch.is_grad_enabled() and (x.requires_grad or self.gate_up_proj.requires_grad)
        return (
            self.gate_up_bias is None
            and self.down_bias is None
            and not grad
            and x.dtype in _PADDED_DTYPES
            and x.dtype == self.gate_up_proj.dtype
        )

    def padded(self, x: Tensor, routing: PaddedRouting) -> Tensor:
        """x [T, H] -> [T * k, H] each (token, expert) pair's output, in pair order: one
        bmm per weight over [E, capacity, in]; zeros in the unused rows (their outputs are
        dropped)."""
        assert self.gate_up_proj is not None and self.down_proj is not None
        experts, capacity, slots = self.num_experts, routing.capacity, routing.slots
        top_k = routing.num_rows // x.shape[0]
        pairs = x if top_k == 1 else x.repeat_interleave(top_k, dim=0)  # [N, H]
        padded = x.new_zeros(experts * capacity, x.shape[1])
        padded.index_copy_(0, slots, pairs)
        h = torch.bmm(padded.view(experts, capacity, -1), self.gate_up_proj.transpose(1, 2))
        out = torch.bmm(self._activate(h), self.down_proj.transpose(1, 2))  # [E, C, H]
        return out.view(experts * capacity, -1).index_select(0, slots)

    def checkpoint_views(self) -> dict[str, tuple[str, tuple[int | slice, ...]]]:
        """Per-expert checkpoint names -> (the stacked parameter holding it, its index there).

        ``{e}.gate_proj.*`` and ``{e}.up_proj.*`` (or ``{e}.up_proj.*`` alone when not
        gated) are rows of ``gate_up_proj`` / ``gate_up_bias``; ``{e}.down_proj.*`` is
        ``down_proj[e]`` / ``down_bias[e]``. Loading a checkpoint copies into those parts.
        """
        inter = self.intermediate
        inputs = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
        if not self.gated:
            inputs = {"up_proj": slice(0, inter)}
        views: dict[str, tuple[str, tuple[int | slice, ...]]] = {}
        for e in range(self.num_experts):
            for name, rows in inputs.items():
                views[f"{e}.{name}.weight"] = ("gate_up_proj", (e, rows))
                if self.gate_up_bias is not None:
                    views[f"{e}.{name}.bias"] = ("gate_up_bias", (e, rows))
            views[f"{e}.down_proj.weight"] = ("down_proj", (e,))
            if self.down_bias is not None:
                views[f"{e}.down_proj.bias"] = ("down_bias", (e,))
        return views


def moe_forward(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    grouped: GroupedExperts,
    sum_dtype: torch.dtype | None = None,
    *,
    padded: bool = True,
) -> Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``: [T, H] in ``sum_dtype``.

    Args:
        x: [T, H] expert input.
        weights: [T, k] routing weights; the products take their dtype promotion.
        experts: [T, k] expert ids.
        sum_dtype: dtype of the weighted terms and their sum (default x's; NemotronH fp32).
        padded: whether a decode-sized batch may take the padded layout; False: always
            the sorted one, whose sizes depend on no value (the graphs trace it once
            for every batch; the same bits in bf16 and fp16).
    """
    layout = grouped.padded_routing(x, experts) if padded else None
    if layout is not None:  # decode-sized: pair order throughout
        rows = grouped.padded(x, layout) * weights.reshape(-1, 1)  # [N, H]
        return combine_pairs(rows.to(sum_dtype or x.dtype), experts)
    routing = ExpertRouting(experts, grouped.num_experts)
    rows = grouped(routing.sort(x), routing) * routing.sort_weights(weights)  # [N, H]
    return routing.combine(rows.to(sum_dtype or x.dtype))


class SparseMoE(nn.Module):
    """Softmax top-k router over experts, plus an optional sigmoid-gated shared expert.

    Qwen3-Next / Qwen3.5-MoE: ``out = sum_k p_k expert_k(x) + sigmoid(g(x)) * shared(x)``,
    the top-k probabilities renormalised when ``norm_topk_prob``.
    """

    def __init__(
        self,
        hidden: int,
        moe_intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        shared_intermediate: int = 0,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden, moe_intermediate, activation(act))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate > 0:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return top_p.to(logits.dtype), top_i

    def forward(self, x: Tensor, *, padded: bool = True) -> Tensor:
        """x [T, H] -> [T, H]; ``padded``: as :func:`moe_forward`'s."""
        weights, experts = self.route(x)  # [T, k]
        out = moe_forward(x, weights, experts, self.experts, padded=padded)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
