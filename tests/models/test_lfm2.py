"""LFM2 (short conv + attention with q/k norm) over paged caches, against transformers (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
from hybrid_checks import TransformersChecks, build
from tiny import VOCAB_SIZE

CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 144,  # auto-adjusted: int(2 * 144 / 3) = 96, rounded up to 32s
    "block_multiple_of": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
    "conv_bias": True,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return build("lfm2", CONFIG, tmp_path_factory.mktemp("lfm2"))


class TestLfm2(TransformersChecks):
    """Prefill, greedy decode, chunked prefill and batching against transformers."""
