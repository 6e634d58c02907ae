"""Grouped-matmul MoE (tokens sorted by expert) against the loop over experts it replaced.

The reference is the former code of every family, kept here: for each expert with tokens,
``torch.where`` finds its (token, slot) pairs, the expert runs as separate ``F.linear``
calls, and ``index_add_`` accumulates the weighted rows in ascending expert order. The
grouped path must give the same bits (fp32 and bf16), also when an expert gets no token,
for k = 1..3, with biases (per-expert fallback), with row strides ``F.grouped_mm`` rejects,
and for every family's block.

Bit-identical needs an intermediate size that is a multiple of 16 (every real model's, and
the tiny test models' 32): an elementwise op (SiLU) computes a tensor's last partial vector
with its scalar formula, which rounds differently, and the grouped path's tensors end
elsewhere than one expert's did. Other sizes are checked to a float tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.layers import packed_linear
from hybridkv.layers.mlp import activation
from hybridkv.layers.moe import (
    ExpertRouting,
    GroupedExperts,
    PaddedRouting,
    SparseMoE,
    combine_pairs,
    moe_forward,
)
from hybridkv.models.granitemoehybrid import GraniteMoE
from hybridkv.models.lfm2 import SigmoidRouterMoE
from hybridkv.models.nemotron_h import NemotronHMoE, relu_squared

DTYPES = [torch.float32, torch.bfloat16]


def loop_reference(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    expert: Callable[[int, Tensor], Tensor],
    sum_dtype: torch.dtype,
) -> Tensor:
    """The former per-expert loop (SparseMoE, GraniteMoE and NemotronHMoE all had it)."""
    out = torch.zeros(x.shape, dtype=sum_dtype)
    for expert_id in torch.unique(experts).tolist():
        token, slot = torch.where(experts == expert_id)
        y = expert(expert_id, x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(sum_dtype))
    return out


def reference_expert(grouped: GroupedExperts) -> Callable[[int, Tensor], Tensor]:
    """One expert as the former modules computed it: gate and up as separate linears."""
    inter = grouped.intermediate

    def bias(b: Tensor | None, e: int, rows: slice) -> Tensor | None:
        return None if b is None else b[e, rows]

    def run(e: int, x: Tensor) -> Tensor:
        w_in, b_in = grouped.gate_up_proj[e], grouped.gate_up_bias
        up = F.linear(
            x,
            w_in[inter:] if grouped.gated else w_in,
            bias(b_in, e, slice(inter, None) if grouped.gated else slice(None)),
        )
        h = (
            grouped.act(F.linear(x, w_in[:inter], bias(b_in, e, slice(0, inter)))) * up
            if grouped.gated
            else grouped.act(up)
        )
        down_bias = None if grouped.down_bias is None else grouped.down_bias[e]
        return F.linear(h, grouped.down_proj[e], down_bias)

    return run


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> Tensor:
    """[T, k] distinct experts per token; expert 0 is never chosen (an empty group)."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, 0] = -1.0
    return scores.topk(top_k, dim=-1).indices


EXPERT_SHAPES = pytest.mark.parametrize(
    ("hidden", "inter", "top_k", "gated", "bias"),
    [
        (64, 32, 2, True, False),  # the tests' tiny models
        (64, 32, 1, True, False),
        (48, 40, 3, True, False),
        (40, 24, 2, True, False),  # 80-byte bf16 rows: grouped_mm refuses, per-expert path
        (64, 32, 2, False, False),  # NemotronH: relu^2, no gate
        (64, 32, 2, False, True),  # NemotronH mlp_bias
    ],
)


@pytest.mark.parametrize("packed", [False, True], ids=["stacked", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@EXPERT_SHAPES
@pytest.mark.parametrize("num_tokens", [1, 7, 96])
def test_grouped_experts_equal_the_loop(
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    top_k: int,
    gated: bool,
    bias: bool,
    num_tokens: int,
    packed: bool,
) -> None:
    """Stacked weights (grouped / padded / per-expert paths) and, packed for oneDNN
    (``pack_weights``, the engine's CPU path), each expert's own packed linears."""
    gen = torch.Generator().manual_seed(hidden * 1000 + inter * 10 + top_k)
    act = activation("silu") if gated else relu_squared
    grouped = GroupedExperts(6, hidden, inter, act, gated=gated, bias=bias).to(dtype)
    for p in grouped.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    expert = reference_expert(copy.deepcopy(grouped))  # the stacked weights, unpacked
    if packed:
        if not packed_linear.can_pack(dtype):
            pytest.skip(f"oneDNN cannot pack {dtype} here (no oneDNN, or bf16 on AVX2 alone)")
        assert grouped.pack_weights(min_elements=0) == 12
        assert grouped.gate_up_proj is None and grouped.down_proj is None
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    experts = random_routing(num_tokens, 6, top_k, gen)
    for weight_dtype, sum_dtype in [(dtype, dtype), (torch.float32, torch.float32)]:
        weights = torch.rand(num_tokens, top_k, generator=gen).to(weight_dtype)
        with torch.no_grad():
            ours = moe_forward(x, weights, experts, grouped, sum_dtype=sum_dtype)
            ref = loop_reference(x, weights, experts, expert, sum_dtype)
        assert ours.dtype == ref.dtype
        # packed fp32 products agree with F.linear's to rounding only (oneDNN vs MKL)
        if inter % 16 == 0 and not (packed and dtype == torch.float32):
            assert torch.equal(ours, ref)
        else:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_no_tokens_give_an_empty_output(dtype: torch.dtype) -> None:
    """Regression: the combine's reshape of zero rows failed (an ambiguous -1)."""
    grouped = GroupedExperts(6, 16, 8, activation("silu")).to(dtype)
    x = torch.empty(0, 16, dtype=dtype)
    experts = torch.empty(0, 2, dtype=torch.int64)
    with torch.no_grad():
        out = moe_forward(x, torch.empty(0, 2, dtype=dtype), experts, grouped)
    assert out.shape == (0, 16) and out.dtype == dtype


def test_experts_stay_stacked_where_onednn_cannot_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with AVX2 alone: pack_weights packs nothing and the stacked weights
    keep serving (as if this CPU were one)."""
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype: False)
    grouped = GroupedExperts(4, 64, 32, activation("silu")).to(torch.bfloat16)
    assert grouped.pack_weights(min_elements=0) == 0
    assert grouped.packed is None and grouped.gate_up_proj is not None


def test_small_experts_are_not_packed() -> None:
    grouped = GroupedExperts(4, 64, 32, activation("silu")).to(torch.bfloat16)
    assert grouped.pack_weights(min_elements=4 * 64 * 64 + 1) == 0
    assert grouped.packed is None and grouped.gate_up_proj is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "padded"), [(1, False), (4, True), (64, True), (400, False)]
)
def test_padded_experts_equal_the_loop(dtype: torch.dtype, num_tokens: int, padded: bool) -> None:
    """Decode-sized batches take the padded bmm layout (zeros in the unused rows), large
    ones and T=1 the grouped one; both equal the per-expert loop bit for bit in bf16/fp16."""
    gen = torch.Generator().manual_seed(num_tokens)
    grouped = GroupedExperts(8, 64, 32, activation("silu")).to(dtype)
    for p in grouped.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    experts = torch.rand(num_tokens, 8, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(num_tokens, 2, generator=gen).to(dtype)
    routing = PaddedRouting.for_batch(experts, 8)
    assert (routing is not None) is padded
    with torch.no_grad():
        assert (grouped.padded_routing(x, experts) is not None) is padded
    if routing is not None:
        slots = routing.slots
        assert slots.unique().numel() == routing.num_rows  # one slot per row
        assert int(slots.max()) < 8 * routing.capacity
    with torch.no_grad():
        ours = moe_forward(x, weights, experts, grouped)
        ref = loop_reference(x, weights, experts, reference_expert(grouped), dtype)
    assert torch.equal(ours, ref)


def test_fp32_experts_keep_the_grouped_layout() -> None:
    """fp32 bmm rows differ from F.linear's in the last bits (MKL), so fp32 never pads."""
    grouped = GroupedExperts(8, 64, 32, activation("silu"))
    x = torch.randn(64, 64)
    with torch.no_grad():
        assert not grouped._padded_ok(x)
        assert grouped.to(torch.bfloat16)._padded_ok(x.to(torch.bfloat16))
    assert not grouped._padded_ok(x.to(torch.bfloat16))  # autograd records: grouped path


def test_padded_layout_is_the_sorted_one_in_pair_order() -> None:
    """Each (token, expert) pair's slot is its expert's group start plus its rank in token
    order, as the sorted layout places it; the capacity is the largest group."""
    experts = torch.tensor([[2, 0], [0, 3], [3, 2], [1, 2]])
    routing = PaddedRouting(experts, num_experts=5)
    assert routing.capacity == 3  # expert 2: tokens 0, 2, 3
    # pairs (t, e): (0,2) (0,0) (1,0) (1,3) (2,3) (2,2) (3,1) (3,2)
    assert routing.slots.tolist() == [6, 0, 1, 9, 10, 7, 3, 8]
    sorted_layout = ExpertRouting(experts, num_experts=5)
    starts = (sorted_layout.offsets - sorted_layout.counts).tolist()
    rank_in_sorted = torch.empty(8, dtype=torch.long)
    rank_in_sorted[sorted_layout.order] = torch.arange(8)
    for i, e in enumerate(experts.reshape(-1).tolist()):
        assert routing.slots[i] == e * 3 + int(rank_in_sorted[i]) - starts[e]


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_pair_terms_add_in_ascending_expert_order(top_k: int) -> None:
    """combine_pairs adds each token's terms in ascending expert order, the sorted layout's
    (and the former loop's) order, whatever order the router listed them in."""
    gen = torch.Generator().manual_seed(top_k)
    experts = torch.rand(5, 6, generator=gen).argsort(dim=1)[:, :top_k]  # shuffled ids
    rows = (torch.randn(5 * top_k, 16, generator=gen) * 1e3).to(torch.bfloat16)
    routing = ExpertRouting(experts, num_experts=6)
    sorted_rows = rows.index_select(0, routing.order)
    assert torch.equal(combine_pairs(rows, experts), routing.combine(sorted_rows))


def test_routing_layout() -> None:
    """Rows grouped by expert (token order inside), offsets at group ends, combine rows."""
    experts = torch.tensor([[2, 0], [0, 3], [3, 2]])
    routing = ExpertRouting(experts, num_experts=5)
    assert routing.order.tolist() == [1, 2, 0, 5, 3, 4]  # flat t*k+j, sorted by expert
    assert routing.token.tolist() == [0, 1, 0, 2, 1, 2]
    assert routing.offsets.tolist() == [2, 2, 4, 6, 6]
    # each token's rows, ascending expert: token 0 -> experts (0, 2) -> rows (0, 2)
    assert routing.combine_rows.tolist() == [[0, 2], [1, 4], [3, 5]]


def seeded_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in module.named_buffers():
            if "bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


def sparse_moe_reference(moe: SparseMoE, x: Tensor) -> Tensor:
    weights, experts = moe.route(x)
    out = loop_reference(x, weights, experts, reference_expert(moe.experts), x.dtype)
    if moe.shared_expert is not None and moe.shared_expert_gate is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


NEMOTRON_CFG = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
}


def nemotron_reference(moe: NemotronHMoE, x: Tensor) -> Tensor:
    weights, experts = moe.gate(x)
    h = moe.fc1_latent_proj(x)
    routed = loop_reference(h, weights, experts, reference_expert(moe.experts), torch.float32)
    return moe.fc2_latent_proj(routed.to(x.dtype)) + moe.shared_experts(x)


def granite_reference(moe: GraniteMoE, x: Tensor) -> Tensor:
    logits = moe.router.layer(x).float()
    top_logits, experts = logits.topk(moe.top_k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1).type_as(x)

    def fused(e: int, rows: Tensor) -> Tensor:  # Granite's loop ran [gate | up] fused
        gate, up = F.linear(rows, moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(moe.experts.act(gate) * up, moe.experts.down_proj[e])

    return loop_reference(x, weights, experts, fused, x.dtype)


FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., Tensor]]] = {
    "qwen": (lambda: SparseMoE(64, 32, 6, 2, shared_intermediate=48), sparse_moe_reference),
    "jamba": (lambda: SparseMoE(64, 32, 5, 2, norm_topk_prob=False), sparse_moe_reference),
    "lfm2_moe": (
        lambda: SigmoidRouterMoE(
            {
                "hidden_size": 64,
                "moe_intermediate_size": 32,
                "num_experts": 6,
                "num_experts_per_tok": 3,
                "routed_scaling_factor": 1.7,
            }
        ),
        sparse_moe_reference,
    ),
    "granite": (lambda: GraniteMoE(64, 32, 4, 2, "silu"), granite_reference),
    "nemotron_h": (lambda: NemotronHMoE(NEMOTRON_CFG, 64), nemotron_reference),
    "nemotron_h_latent": (
        lambda: NemotronHMoE({**NEMOTRON_CFG, "moe_latent_size": 48, "mlp_bias": True}, 64),
        nemotron_reference,
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_blocks_equal_their_former_loop(family: str, dtype: torch.dtype) -> None:
    make, reference = FAMILIES[family]
    moe = make()
    seeded_(moe, seed=len(family))
    moe = moe.to(dtype)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert torch.equal(moe(x), reference(moe, x))


def test_checkpoint_views_name_the_parts_of_the_stacked_weights() -> None:
    grouped = GroupedExperts(3, 8, 4, activation("silu"), bias=True)
    views = grouped.checkpoint_views()
    assert len(views) == 3 * 6
    owner, index = views["1.up_proj.weight"]
    assert owner == "gate_up_proj"
    part = grouped.gate_up_proj.data[index]
    assert part.shape == (4, 8)
    part.copy_(torch.full((4, 8), 7.0))
    assert torch.equal(grouped.gate_up_proj[1, 4:], torch.full((4, 8), 7.0))
    assert not torch.equal(grouped.gate_up_proj[1, :4], torch.full((4, 8), 7.0))
    owner, index = views["2.down_proj.bias"]
    assert owner == "down_bias" and grouped.down_bias.data[index].shape == (8,)
