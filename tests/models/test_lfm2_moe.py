"""LFM2-MoE (short conv + attention, sigmoid-routed experts) against transformers (fp32).

Variants differ in seed, layer pattern, dense/sparse split and routing switches; ``odd``
has hidden 40 and a 4-tap conv, so a 16-token KV page (5120 B, two attention layers) is no
multiple of a conv state page (1440 B, three conv layers). The expert bias is a buffer
that random init leaves at zero: it gets seeded noise large enough to change which experts
are picked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_checks import (
    TransformersChecks,
    make_hf,
    prompt,
)
from tiny import VOCAB_SIZE, save_checkpoint

from hybridkv.models.lfm2 import SigmoidRouterMoE
from hybridkv.models.loader import load_model

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 32,
    "conv_bias": True,
    "initializer_range": 0.1,  # peakier logits: fewer near-ties in greedy tests
}
VARIANTS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (seed, config)
    "base": (
        0,
        {
            **COMMON,
            "hidden_size": 64,
            "intermediate_size": 96,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "num_hidden_layers": 4,
            "num_dense_layers": 1,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "routed_scaling_factor": 1.7,
        },
    ),
    "odd": (
        1,
        {
            **COMMON,
            "hidden_size": 40,
            "intermediate_size": 72,
            "conv_L_cache": 4,
            "layer_types": ["full_attention", "conv", "conv", "full_attention", "conv"],
            "num_hidden_layers": 5,
            "num_dense_layers": 2,
            "num_experts": 5,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "initializer_range": 0.2,  # at 0.1 greedy repeats 3 tokens
        },
    ),
    "no_bias": (
        2,
        {
            **COMMON,
            "hidden_size": 48,
            "intermediate_size": 64,
            "layer_types": ["conv", "conv", "full_attention"],
            "num_hidden_layers": 3,
            "num_dense_layers": 0,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "use_expert_bias": False,
            "routed_scaling_factor": 0.6,
            "initializer_range": 0.2,  # at 0.1 greedy repeats 1 token
        },
    ),
}


def build_lfm2_moe(seed: int, config: dict[str, Any], model_dir: Path) -> tuple[Any, Any]:
    """As :func:`build`, plus a non-zero expert bias (a buffer, not perturbed)."""
    hf = make_hf("lfm2_moe", config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
    return hf, load_model(save_checkpoint(hf, model_dir), "float32")


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    seed, config = VARIANTS[request.param]
    return build_lfm2_moe(seed, config, tmp_path_factory.mktemp(f"lfm2_moe_{request.param}"))


class TestLfm2Moe(TransformersChecks):
    """Prefill, greedy decode, chunked prefill and batching against transformers."""


def test_layers_are_dense_then_sparse_and_bias_changes_routing(tiny: tuple[Any, Any]) -> None:
    """The split follows ``num_dense_layers``; with a bias, some token picks other experts."""
    hf, lm = tiny
    num_dense = int(hf.config.num_dense_layers)
    layers = lm.model.model.layers
    sparse = [
        i for i, layer in enumerate(layers) if isinstance(layer.feed_forward, SigmoidRouterMoE)
    ]
    assert sparse == list(range(num_dense, len(layers)))
    moe = layers[sparse[0]].feed_forward
    if not hf.config.use_expert_bias:
        assert moe.expert_bias is None
        return
    x = lm.model.model.embed_tokens(torch.tensor(prompt(1, 40)))
    _, biased = moe.route(x)
    unbiased = moe.gate(x).sigmoid().topk(moe.top_k, dim=-1).indices
    assert (biased.sort(-1).values != unbiased.sort(-1).values).any()
