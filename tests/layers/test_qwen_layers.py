"""Qwen3-Next building blocks against their transformers counterparts (weights copied)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layers.moe import SparseMoE
from hybridkv.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm
from hybridkv.layers.rope import RotaryEmbedding, apply_rope, apply_rope_, rope_settings

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("width", [12, 64, 512, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_round_like_transformers(dtype: torch.dtype, width: int) -> None:
    """Bitwise, at the widths of heads and hidden states: the norms are one fused op
    (``rms_normalize``) where transformers runs pow, mean, add, rsqrt and mul."""
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(5, width, generator=gen) * 3, torch.randn(5, width, generator=gen)
    weight = torch.randn(width, generator=gen) * 0.1
    ours, theirs = ZeroCenteredRMSNorm(width).to(dtype), hf.Qwen3NextRMSNorm(width).to(dtype)
    gated_ours = GatedRMSNorm(width).to(dtype)
    gated_theirs = hf.Qwen3NextRMSNormGated(width).to(dtype)
    with torch.no_grad():
        for module in (ours, theirs, gated_ours, gated_theirs):
            module.weight.copy_(weight)
        assert torch.equal(ours(x.to(dtype)), theirs(x.to(dtype)))
        assert torch.equal(
            gated_ours(x.to(dtype), gate.to(dtype)), gated_theirs(x.to(dtype), gate.to(dtype))
        )


def test_partial_rope_matches_transformers() -> None:
    cfg = transformers.Qwen3NextConfig(head_dim=24, num_attention_heads=4, hidden_size=64)
    rotary_dim, theta = rope_settings(cfg.to_dict(), 24)
    assert rotary_dim == 6  # partial_rotary_factor 0.25
    positions = torch.tensor([0, 5, 17, 300])
    q, k = torch.randn(4, 3, 24), torch.randn(4, 2, 24)
    cos, sin = RotaryEmbedding(rotary_dim, theta)(positions, torch.float32)
    ref_cos, ref_sin = hf.Qwen3NextRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin
    )
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1))


def test_legacy_rope_keys_and_unsupported_scaling() -> None:
    assert rope_settings({"rope_theta": 1e7, "partial_rotary_factor": 0.5}, 256) == (128, 1e7)
    with pytest.raises(NotImplementedError):
        rope_settings({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 64)


def test_moe_matches_transformers_block() -> None:
    cfg = transformers.Qwen3NextConfig(
        hidden_size=16,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    ref = hf.Qwen3NextSparseMoeBlock(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = SparseMoE(16, 8, 5, 2, norm_topk_prob=False, shared_intermediate=12)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        ours.shared_expert.load_state_dict(ref.shared_expert.state_dict())
        ours.shared_expert_gate.load_state_dict(ref.shared_expert_gate.state_dict())
        x = torch.randn(7, 16)
        torch.testing.assert_close(ours(x), ref(x[None])[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(24, 6), (16, 16), (256, 64)])
def test_rope_in_place_is_bitwise_apply_rope(
    head_dim: int, rotary_dim: int, dtype: torch.dtype
) -> None:
    """The engine's in-place RoPE (one cat, the sign folded into the sin table) equals
    the reference apply_rope bit for bit, on a tensor and on the query half of a
    [query | gate] projection (a strided view; the gate half stays untouched)."""
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 3, 17, 300, 4095])
    rotary = RotaryEmbedding(rotary_dim, 1e4)
    cos, sin = rotary(positions, dtype)
    tables = rotary.tables(positions, dtype)
    assert torch.equal(tables.cos, cos) and torch.equal(tables.sin, sin)
    half = rotary_dim // 2
    assert torch.equal(tables.signed_sin[:, 0], torch.cat([-sin[:, :half], sin[:, half:]], -1))
    x = (torch.randn(5, 3, head_dim, generator=gen) * 4).to(dtype)
    assert torch.equal(apply_rope_(x.clone(), tables), apply_rope(x, cos, sin))
    packed = (torch.randn(5, 3, 2 * head_dim, generator=gen) * 4).to(dtype)
    query, gate = packed.clone().split(head_dim, dim=-1)
    apply_rope_(query, tables)
    want_query, want_gate = packed.split(head_dim, dim=-1)
    assert torch.equal(query, apply_rope(want_query, cos, sin))
    assert torch.equal(gate, want_gate)


def test_zero_centred_norm_scale_follows_its_weight() -> None:
    """``1 + w`` is computed once, and again whenever the weight is loaded, updated in
    place, replaced or cast: the output always equals the formula on the current weight."""
    norm = ZeroCenteredRMSNorm(8)
    x = torch.randn(3, 8)

    def want() -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)).to(
            x.dtype
        )

    with torch.no_grad():
        first = norm(x)
        assert norm.scale() is norm.scale()  # cached
        torch.testing.assert_close(first, want())
        norm.weight.add_(0.5)  # in place (an optimizer step)
        torch.testing.assert_close(norm(x), want())
        norm.load_state_dict({"weight": torch.full((8,), -0.25)})
        torch.testing.assert_close(norm(x), want())
        norm.weight = torch.nn.Parameter(torch.full((8,), 2.0))  # replaced
        torch.testing.assert_close(norm(x), want())
        before = norm.scale()
        norm.to(torch.float64)  # cast: new storage
        assert norm.scale() is not before and torch.equal(norm.scale(), before)
    y = norm(x.double())  # with grad: no cache, a graph to the weight
    y.sum().backward()
    assert norm.weight.grad is not None
