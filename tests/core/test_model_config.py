"""config.json → ModelSpec: built-in configs against their ``_computed`` figures; legacy forms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.core.families import ModelConfigError
from hybridkv.core.model_config import (
    builtin_model_names,
    load_config_dict,
    load_model_spec,
    model_spec_from_config,
)
from hybridkv.core.spec import RecurrentStateSpec

BF16 = {"kv_dtype": "bfloat16", "conv_dtype": "bfloat16"}


def test_there_are_builtin_models() -> None:
    names = builtin_model_names()
    assert len(names) >= 29
    assert "qwen3.5-0.8b" in names
    assert "ASSUMPTIONS" not in names


@pytest.mark.parametrize("name", builtin_model_names())
def test_builtin_config_matches_its_computed_figures(name: str) -> None:
    _, raw = load_config_dict(name)
    expected = raw["_computed"]
    all_bf16 = load_model_spec(name, **BF16, ssm_dtype="bfloat16")
    default = load_model_spec(name, **BF16)
    ssm_fp32 = load_model_spec(name, **BF16, ssm_dtype="float32")
    assert all_bf16.num_attention_layers == expected["n_attention_layers"]
    assert all_bf16.num_recurrent_layers == expected["n_recurrent_layers"]
    assert all_bf16.kv_bytes_per_token == expected["attn_kv_bytes_per_token_bf16"]
    assert all_bf16.state_bytes_per_seq == expected["state_bytes_per_request_all_bf16"]
    assert default.state_bytes_per_seq == expected["state_bytes_per_request_vllm_default"]
    assert ssm_fp32.state_bytes_per_seq == expected["state_bytes_per_request_ssm_fp32"]


@pytest.mark.parametrize("name", builtin_model_names())
def test_builtin_groups_are_consistent(name: str) -> None:
    spec = load_model_spec(name)
    groups = spec.groups
    assert sum(g.num_layers for g in groups) == len(spec.layers)
    assert [g.group_id for g in groups] == list(range(len(groups)))
    recurrent = [g.is_recurrent for g in groups]
    assert recurrent == sorted(recurrent)  # token groups first
    assert all(0 <= layer.layer_index < spec.num_layers for layer in spec.layers)


# What ``--mamba-ssm-cache-dtype auto`` gives a bf16 model, family by family: the table in
# docs/architecture.md ("Recurrent state dtype"), chosen with benchmarks/ssm_state_dtype.py.
AUTO_SSM_DTYPE = {
    "qwen3-next-80b-a3b-instruct": "bfloat16",  # GDN, no mamba_ssm_dtype: the model dtype
    "qwen3.5-0.8b": "bfloat16",
    "qwen3.5-27b": "float32",  # ships mamba_ssm_dtype float32
    "qwen3.5-35b-a3b": "float32",  # assumed like the 27B (model_data/ASSUMPTIONS.json)
    "nemotron-h-8b-base-8k": "float32",  # Nemotron-H: mamba_ssm_cache_dtype, default fp32
    "nvidia-nemotron-nano-9b-v2": "float32",
    "bamba-9b": "bfloat16",  # other Mamba2 hybrids: the model dtype
    "granite-4.0-h-tiny": "bfloat16",
    "falcon-h1-7b": "bfloat16",
    "zamba2-7b": "bfloat16",
    "ai21-jamba-1.5-mini": "bfloat16",  # Mamba1: the model dtype
    "kimi-linear-48b-a3b-instruct": "float32",  # KDA: always fp32
    "lfm2-1.2b": None,  # short conv only: no SSM state
}


@pytest.mark.parametrize(("name", "expected"), sorted(AUTO_SSM_DTYPE.items()))
def test_auto_ssm_state_dtype_per_family(name: str, expected: str | None) -> None:
    spec = load_model_spec(name, **BF16)  # ssm_dtype None: "auto"
    state: dict[str, set[str]] = {}
    for layer in spec.layers:
        if isinstance(layer.spec, RecurrentStateSpec):
            for t in layer.spec.tensors:
                state.setdefault(t.name, set()).add(t.dtype)
    assert state.get("ssm") == (None if expected is None else {expected})
    assert state["conv"] == {"bfloat16"}  # the conv state always keeps the model dtype


# ----------------------------------------------------------------------------- legacy forms

QWEN_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}


def layout_of(raw: dict[str, Any]) -> list[tuple[int, str]]:
    spec = model_spec_from_config(raw)
    return [
        (layer.layer_index, "R" if isinstance(layer.spec, RecurrentStateSpec) else "A")
        for layer in spec.layers
    ]


def kinds(raw: dict[str, Any]) -> str:
    """One letter per decoder layer: A attention, R recurrent, B both, - none."""
    by_layer: dict[int, str] = {}
    for index, kind in layout_of(raw):
        by_layer[index] = "B" if index in by_layer else kind
    n = model_spec_from_config(raw).num_layers
    return "".join(by_layer.get(i, "-") for i in range(n))


def test_qwen_layer_types_and_full_attention_interval_agree() -> None:
    words = ["linear_attention"] * 3 + ["full_attention"]
    with_types = {**QWEN_TEXT, "layer_types": words * 2}
    with_interval = {**QWEN_TEXT, "full_attention_interval": 4}
    assert kinds(with_types) == kinds(with_interval) == "RRRARRRA"
    assert model_spec_from_config(with_types) == model_spec_from_config(with_interval)


def test_vlm_text_config_nesting_wins_over_the_wrapper() -> None:
    wrapper = {
        "model_type": "qwen3_5",
        "hidden_size": 999,  # the vision wrapper's own value: ignored
        "text_config": {**QWEN_TEXT, "full_attention_interval": 4},
    }
    flat = {**QWEN_TEXT, "full_attention_interval": 4}
    nested = model_spec_from_config(wrapper)
    assert nested.model_type == "qwen3_5_text"
    assert nested.layers == model_spec_from_config(flat).layers


NEMOTRON: dict[str, Any] = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "ssm_state_size": 8,
    "n_groups": 1,
    "conv_kernel": 4,
}


def test_nemotron_pattern_string_and_layers_block_type_agree() -> None:
    letters = {**NEMOTRON, "hybrid_override_pattern": "M-M*EM"}
    words = {
        **NEMOTRON,
        "layers_block_type": ["mamba", "mlp", "mamba", "attention", "moe", "mamba"],
    }
    assert kinds(letters) == kinds(words) == "R-RA-R"


def test_nemotron_unknown_pattern_letter() -> None:
    with pytest.raises(ModelConfigError, match="unknown letters"):
        model_spec_from_config({**NEMOTRON, "hybrid_override_pattern": "MX*M-M"})


LFM2: dict[str, Any] = {
    "model_type": "lfm2",
    "num_hidden_layers": 5,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
}


def test_lfm2_full_attn_idxs_and_layer_types_agree() -> None:
    legacy = {**LFM2, "full_attn_idxs": [1, 4]}
    types = {**LFM2, "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention"]}
    assert kinds(legacy) == kinds(types) == "RARRA"
    spec = model_spec_from_config(legacy)
    assert spec.state_bytes_per_seq == 3 * 32 * 2 * 2  # conv (hidden, L_cache - 1), bf16


def test_kimi_full_attention_layers_are_one_based() -> None:
    raw = {
        "model_type": "kimi_linear",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "linear_attn_config": {"full_attn_layers": [2, 4], "num_heads": 2, "head_dim": 8},
    }
    assert kinds(raw) == "RARA"
    with pytest.raises(ModelConfigError, match="out of range"):
        bad = {**raw, "linear_attn_config": {"full_attn_layers": [0, 4]}}  # 0 is not 1-based
        model_spec_from_config(bad)


ZAMBA2: dict[str, Any] = {
    "model_type": "zamba2",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "mamba_headdim": 16,
    "mamba_d_state": 8,
}


def test_zamba2_hybrid_layers_carry_attention_and_state() -> None:
    by_types = {**ZAMBA2, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}
    by_ids = {**ZAMBA2, "hybrid_layer_ids": [1, 3]}
    assert kinds(by_types) == kinds(by_ids) == "RBRB"
    spec = model_spec_from_config(by_types)
    assert spec.num_attention_layers == 2 and spec.num_recurrent_layers == 4


def test_falcon_h1_every_layer_has_both() -> None:
    raw = {
        "model_type": "falcon_h1",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
    }
    assert kinds(raw) == "BBB"


def test_granite_legacy_mamba_attention_words() -> None:
    raw = {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "layer_types": ["mamba", "attention", "Mamba", "mamba"],
    }
    assert kinds(raw) == "RARR"


def test_pattern_length_must_match_the_layer_count() -> None:
    raw = {**QWEN_TEXT, "layer_types": ["full_attention"] * 3}
    with pytest.raises(ModelConfigError, match="num_hidden_layers is 8"):
        model_spec_from_config(raw)


def test_unknown_layer_word() -> None:
    raw = {**QWEN_TEXT, "layer_types": ["full_attention"] * 7 + ["teleport"]}
    with pytest.raises(ModelConfigError, match="'teleport'"):
        model_spec_from_config(raw)


# ----------------------------------------------------------------------------- errors


def test_unknown_model_type() -> None:
    with pytest.raises(ModelConfigError, match="model_type 'bert' is not a supported"):
        model_spec_from_config({"model_type": "bert", "num_hidden_layers": 2})


def test_no_model_type() -> None:
    with pytest.raises(ModelConfigError, match="no model_type"):
        model_spec_from_config({"num_hidden_layers": 2})


def test_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3",')
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model_spec(path)


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_model_spec(path)


def test_missing_file() -> None:
    with pytest.raises(ModelConfigError, match=r"unknown model 'no/such/config\.json'"):
        load_model_spec("no/such/config.json")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        load_model_spec(tmp_path)


def test_missing_required_field() -> None:
    raw = {k: v for k, v in QWEN_TEXT.items() if k != "num_hidden_layers"}
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        model_spec_from_config(raw)


def test_model_dir_and_config_path_load_the_same(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_TEXT, "full_attention_interval": 4}))
    from_dir = load_model_spec(tmp_path)
    from_file = load_model_spec(tmp_path / "config.json")
    assert from_dir.layers == from_file.layers
    assert from_dir.name == tmp_path.name
