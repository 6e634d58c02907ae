"""Falcon-H1 (attention ∥ Mamba2 in every layer, muP multipliers) against transformers (fp32).

Every multiplier is set away from 1 so that each folding rule is exercised. Each test runs
on three variants of the Mamba2 output: the plain ``y * silu(z)`` (``mamba_rms_norm`` off, the
default), the grouped RMSNorm before the gate (``mamba_norm_before_gate``, the default when the
norm is on) and the grouped RMSNorm after the gate.
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
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_d_ssm": 96,
    "mamba_n_heads": 6,
    "mamba_d_head": "auto",
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 16,
    "embedding_multiplier": 1.7,
    "lm_head_multiplier": 0.8,
    "mlp_multipliers": [1.3, 0.7],
    "key_multiplier": 0.9,
    "attention_in_multiplier": 1.1,
    "attention_out_multiplier": 0.6,
    "ssm_multipliers": [1.2, 0.8, 1.5, 0.5, 1.4],
    "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.75,
    "initializer_range": 0.1,
}


VARIANTS: dict[str, dict[str, Any]] = {
    "no_norm": {},
    "norm_then_gate": {"mamba_rms_norm": True},
    "gate_then_norm": {"mamba_rms_norm": True, "mamba_norm_before_gate": False},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = {**CONFIG, **VARIANTS[request.param]}
    return build("falcon_h1", config, tmp_path_factory.mktemp(f"falcon_h1_{request.param}"))


class TestFalconH1(TransformersChecks):
    """Prefill, greedy decode, chunked prefill and batching against transformers."""
