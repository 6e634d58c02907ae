"""fp32 matmuls for a bf16 / fp16 model: the model dtype's products up to summation order.

A converted linear rounds ``fp32(x) @ fp32(W)^T`` to the model dtype, so its output is
the bf16 kernel's (which also sums in fp32) up to the order of the sums. Weights that
something else reads by name (``keep_plain``) are never converted; a tied LM head and its
embedding are converted together, onto one fp32 table (``upcast_tied_pair``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.layers.fp32_matmul import (
    Fp32Embedding,
    Fp32Linear,
    upcast_linears,
    upcast_tied_pair,
)
from hybridkv.layers.moe import ExpertRouting, GroupedExperts, moe_forward
from hybridkv.layers.packed_linear import keep_plain, pack_linears

REDUCED = [torch.bfloat16, torch.float16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of the larger magnitude's last place (bf16 / fp16)."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_products_are_fp32_sums_rounded_to_the_model_dtype(
    dtype: torch.dtype, bias: bool, rows: int
) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    module = Fp32Linear.from_linear(linear)
    with torch.inference_mode():
        out = module(x)
        b = None if linear.bias is None else linear.bias.float()
        assert out.dtype == dtype
        assert torch.equal(out, F.linear(x.float(), linear.weight.float(), b).to(dtype))
        assert ulps(out, linear(x)) <= 1.0  # the model dtype's kernel: one rounding apart


class Tiny(nn.Module):
    """Every case upcast_linears must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 48)
        self.read_by_weight = keep_plain(nn.Linear(32, 32))
        self.shared = nn.Linear(32, 32, bias=False)
        self.block_a = nn.Sequential(self.shared)
        self.block_b = nn.Sequential(self.shared)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_upcast_converts_what_nothing_else_reads() -> None:
    model = Tiny().to(torch.bfloat16)
    embed_weight = model.embed.weight
    assert upcast_linears(model) == 2  # proj and the shared linear (once)
    assert isinstance(model.proj, Fp32Linear)
    assert model.proj.inner.weight.dtype == torch.float32
    assert isinstance(model.block_a[0], Fp32Linear) and model.block_a[0] is model.block_b[0]
    assert model.shared is model.block_a[0]
    assert type(model.read_by_weight) is nn.Linear  # keep_plain
    assert type(model.head) is nn.Linear and model.head.weight is embed_weight  # tied
    assert model.read_by_weight.weight.dtype == torch.bfloat16


def test_a_tied_pair_shares_one_fp32_table() -> None:
    """upcast_tied_pair: the head multiplies in fp32, the embedding gives back exactly its
    bf16 rows, and both read the same fp32 tensor (no second copy); an untied or fp32
    pair is returned as is."""
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    rows = model.embed(torch.tensor([3, 0, 49]))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    expected = F.linear(x.float(), model.embed.weight.float()).to(torch.bfloat16)
    embedding, head = upcast_tied_pair(model.embed, model.head)
    assert isinstance(embedding, Fp32Embedding) and isinstance(head, Fp32Linear)
    assert embedding.weight is head.inner.weight and embedding.weight.dtype == torch.float32
    with torch.inference_mode():
        assert torch.equal(embedding(torch.tensor([3, 0, 49])), rows)
        assert torch.equal(head(x), expected)
    untied = Tiny().to(torch.bfloat16)
    untied.head = nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    assert upcast_tied_pair(untied.embed, untied.head) == (untied.embed, untied.head)
    fp32 = Tiny()
    assert upcast_tied_pair(fp32.embed, fp32.head) == (fp32.embed, fp32.head)


def test_upcast_leaves_an_fp32_model_alone() -> None:
    model = Tiny()
    assert upcast_linears(model) == 0
    assert type(model.proj) is nn.Linear


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packing_after_upcast_packs_the_fp32_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_weights after the conversion packs the inner fp32 linear: the same products
    to fp32 rounding, still rounded to bf16."""
    import hybridkv.layers.packed_linear as packed_linear

    monkeypatch.setitem(packed_linear.MIN_PACKED_ELEMENTS, torch.float32, 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    upcast_linears(model)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = model(x)
        assert pack_linears(model) == 1
        assert isinstance(model[0].inner, packed_linear.PackedLinear)
        packed = model(x)
    assert packed.dtype == torch.bfloat16
    assert ulps(packed, plain) <= 1.0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_fp32_products_are_the_same_for_any_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain fp32 products (MKL) may change with the row count, and so, once in a while,
    their bf16 rounding; packed, a row's product is the same in any batch (what
    ``pack_weights`` gives back, fp32_matmul's module doc)."""
    import hybridkv.layers.packed_linear as packed_linear

    monkeypatch.setitem(packed_linear.MIN_PACKED_ELEMENTS, torch.float32, 0)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(1024, 2048, bias=False)).to(torch.bfloat16)
    upcast_linears(model)
    assert pack_linears(model) == 1
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    with torch.inference_mode():
        full = model(x)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(model(x[:rows]), full[:rows]), rows


def expert_reference(x: torch.Tensor, experts: GroupedExperts, ids: list[int]) -> torch.Tensor:
    """Each row through its expert as two Fp32Linear-style products (rounded to x's dtype
    after each), the activation in x's dtype."""
    rows = []
    for row, e in zip(x, ids, strict=True):
        h = F.linear(row[None].float(), experts.gate_up_proj[e].float()).to(x.dtype)
        gate, up = h.split(experts.intermediate, dim=-1)
        act = F.silu(gate) * up
        rows.append(F.linear(act.float(), experts.down_proj[e].float()).to(x.dtype))
    return torch.cat(rows)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_experts_upcast_run_fp32_products_in_the_sorted_layout(tokens: int) -> None:
    """After upcast_weights the experts hold fp32 weights, take the sorted (grouped) layout
    even at decode sizes, and give each row its expert's fp32 products rounded to bf16
    after each; the MoE sum stays within bf16 rounding of the bf16 experts'."""
    torch.manual_seed(tokens)
    experts = GroupedExperts(4, 32, 24, F.silu).to(torch.bfloat16)
    bf16_weights = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    x = torch.randn(tokens, 32, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (tokens, 2))
    weights = torch.softmax(torch.randn(tokens, 2), -1).to(torch.bfloat16)
    with torch.inference_mode():
        before = moe_forward(x, weights, ids, experts)
        assert experts.upcast_weights() == 2 and experts.upcast_weights() == 0
        assert experts.gate_up_proj.dtype == torch.float32
        assert torch.equal(experts.gate_up_proj, bf16_weights[0].float())
        assert experts.padded_routing(x, ids) is None
        routing = ExpertRouting(ids, 4)
        sorted_x = routing.sort(x)
        out = experts(sorted_x, routing)
        expert_of_row = ids.reshape(-1)[routing.order].tolist()
        reference = expert_reference(sorted_x, experts, expert_of_row)
        after = moe_forward(x, weights, ids, experts)
    assert out.dtype == torch.bfloat16
    # MKL's fp32 sums may take another order for another row count: one rounding apart
    assert ulps(out, reference) <= 1.0
    torch.testing.assert_close(after.float(), before.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_experts_upcast_then_packed_give_the_upcast_products() -> None:
    """upcast_weights, then pack_weights (the loader's order with --pack-weights): each
    expert runs packed fp32 linears on bf16 rows, within fp32 rounding of the unpacked
    upcast experts (then rounded to bf16)."""
    torch.manual_seed(4)
    experts = GroupedExperts(4, 32, 24, F.silu).to(torch.bfloat16)
    experts.upcast_weights()
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (9, 2))
    weights = torch.softmax(torch.randn(9, 2), -1).to(torch.bfloat16)
    with torch.inference_mode():
        unpacked = moe_forward(x, weights, ids, experts)
        assert experts.pack_weights(min_elements=0) == 8
        packed = moe_forward(x, weights, ids, experts)
    assert packed.dtype == torch.bfloat16
    assert ulps(packed, unpacked) <= 2.0
