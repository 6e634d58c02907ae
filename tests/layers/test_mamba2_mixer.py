"""Mamba2 mixer on cache pages against transformers' BambaMixer (torch path, no cache)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.core.layout import build_layout
from hybridkv.core.model_config import model_spec_from_config
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.mamba2 import Mamba2Config, Mamba2Mixer

hf_bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
transformers = pytest.importorskip("transformers")

HIDDEN = 24  # mamba_expand 2 -> inner 48 = 6 heads x 8


def make_pair(n_groups: int, seed: int = 0) -> tuple[object, Mamba2Mixer, CacheViews]:
    """A perturbed HF BambaMixer (layer 0), our mixer with its weights, and fp32 cache views."""
    cfg = transformers.BambaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        mamba_n_heads=6,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=n_groups,
        mamba_chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(seed)
    hf = hf_bamba.BambaMixer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = Mamba2Mixer(
        Mamba2Config(
            hidden_size=HIDDEN,
            num_heads=6,
            head_dim=8,
            d_state=8,
            n_groups=n_groups,
            conv_kernel=4,
            chunk_size=8,
            norm_eps=cfg.rms_norm_eps,
        ),
        layer_index=0,
    )
    ours.load_state_dict(hf.state_dict())
    spec = model_spec_from_config(
        cfg.to_dict(), kv_dtype="float32", conv_dtype="float32", ssm_dtype="float32"
    )
    layout = build_layout(spec.groups, block_tokens=16, memory_bytes=1 << 20)
    views = CacheViews.allocate(spec, layout)
    views.arena.fill_(0x7F)  # garbage: fresh requests must not read it
    return hf, ours, views


def step(lens: list[int], computed: list[int], pages: list[int], views: CacheViews) -> ForwardBatch:
    """A batch of requests with ``lens[r]`` new tokens after ``computed[r]`` cached ones."""
    starts = torch.tensor([0, *lens]).cumsum(0)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, lens, strict=True)])
    group = views.state(0).group_id
    return ForwardBatch(
        input_ids=torch.zeros(int(starts[-1]), dtype=torch.int64),
        positions=positions,
        query_start_loc=starts,
        num_computed_tokens=torch.tensor(computed),
        state_pages={group: torch.tensor(pages)},
    )


def run_chunks(
    ours: Mamba2Mixer, views: CacheViews, x: torch.Tensor, cuts: list[int]
) -> torch.Tensor:
    """One request fed in pieces ending at ``cuts``; returns all its outputs."""
    outs, done = [], 0
    for end in [*cuts, x.shape[0]]:
        batch = step([end - done], [done], [1], views)
        outs.append(ours(x[done:end], batch, views))
        done = end
    return torch.cat(outs)


@pytest.mark.parametrize("n_groups", [1, 3])
@pytest.mark.parametrize("cuts", [[], [1], [7, 16, 33], list(range(1, 40))], ids=str)
def test_chunked_and_decoded_equal_hf_full_forward(n_groups: int, cuts: list[int]) -> None:
    hf, ours, views = make_pair(n_groups)
    x = torch.randn(40, HIDDEN)
    with torch.no_grad():
        want = hf(x[None])[0]
        got = run_chunks(ours, views, x, cuts)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_batched_requests_equal_each_alone() -> None:
    hf, ours, views = make_pair(2, seed=1)
    xs = [torch.randn(n, HIDDEN) for n in (19, 5, 11)]
    with torch.no_grad():
        want = [hf(x[None])[0] for x in xs]
        # step 1: prefill 10 / 5 / 1 tokens; step 2: 9 / decode 0 / 10 tokens
        first = [10, 5, 1]
        batch = step(first, [0, 0, 0], [4, 0, 2], views)
        y1 = ours(torch.cat([x[:n] for x, n in zip(xs, first, strict=True)]), batch, views)
        rest = [x[n:] for x, n in zip(xs, first, strict=True)]
        keep = [0, 2]
        batch = step([len(rest[r]) for r in keep], [first[r] for r in keep], [4, 2], views)
        y2 = ours(torch.cat([rest[r] for r in keep]), batch, views)
    got = list(y1.split(first))
    for r, y in zip(keep, y2.split([len(rest[r]) for r in keep]), strict=True):
        got[r] = torch.cat([got[r], y])
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-5 * max(1.0, w.abs().max().item())
