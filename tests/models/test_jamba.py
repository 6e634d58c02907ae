"""Jamba (Mamba1 with dt/B/C norms + attention + MoE) over paged caches, against transformers.

transformers' own chunked prefill is wrong for Mamba1 (its scan restarts from zeros), so
the chunked check compares with its full forward only.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybrid_checks import TransformersChecks, build
from tiny import VOCAB_SIZE

CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_layer_period": 2,  # layers 1, 3 attention; 0, 2 Mamba1
    "attn_layer_offset": 1,
    "expert_layer_period": 2,  # layers 0, 2 MoE (a Mamba and ...), 1, 3 dense
    "expert_layer_offset": 0,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 6,
    "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return build("jamba", CONFIG, tmp_path_factory.mktemp("jamba"))


class TestJamba(TransformersChecks):
    """Prefill, greedy decode, chunked prefill and batching against transformers."""
