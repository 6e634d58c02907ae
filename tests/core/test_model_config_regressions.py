"""Regressions in config parsing found while loading real checkpoints."""

from __future__ import annotations

import pytest

from hybridkv.core.families import ModelConfigError
from hybridkv.core.model_config import model_spec_from_config


def _nemotron_config(**extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "n_groups": 2,
        "conv_kernel": 4,
        "torch_dtype": "float32",
    }
    config.update(extra)
    return config


def test_nemotron_saved_by_transformers_without_num_hidden_layers() -> None:
    """transformers 5 drops num_hidden_layers; the count comes from layers_block_type."""
    pattern = ["mamba", "moe", "attention", "mlp", "mamba"]
    spec = model_spec_from_config(_nemotron_config(layers_block_type=pattern))
    assert spec.num_layers == 5
    assert spec.num_recurrent_layers == 2
    assert spec.num_attention_layers == 1


def test_no_layer_count_and_no_pattern_is_a_clear_error() -> None:
    config = _nemotron_config()
    with pytest.raises(ModelConfigError, match="no num_hidden_layers"):
        model_spec_from_config(config)
