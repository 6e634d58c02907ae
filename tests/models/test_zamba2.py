"""Zamba2 (Mamba2 + shared transformer blocks with per-layer LoRA) against transformers (fp32).

Variants differ in seed, layer pattern, number of shared blocks, adapters, RoPE and GQA.
``odd`` has a hybrid first layer, grouped KV heads and sizes where neither page size divides
the other (16-token KV pages of 12288 B for two hybrid layers, Mamba2 state pages of 24064 B).
transformers saves a shared block once, under its first hybrid layer; the other stored
form (a full copy under every hybrid layer) is written here by renaming keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_checks import (
    TransformersChecks,
    assert_close,
    make_hf,
    prompt,
)
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny import VOCAB_SIZE, hf_logits, save_checkpoint

from hybridkv.layers.attention import PagedAttention
from hybridkv.models.loader import LoadedModel, load_model

L, H = "linear_attention", "hybrid"
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "mamba_d_state": 16,
    "chunk_size": 16,
    "initializer_range": 0.1,  # peakier logits: fewer near-ties in greedy tests
}
VARIANTS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (seed, config)
    "two_blocks": (  # hybrid layers 1, 3, 4 run blocks 0, 1, 0; q/k/v and MLP adapters
        0,
        {
            **COMMON,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 6,
            "layers_block_type": [L, H, L, H, H, L],
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_mamba_heads": 8,
            "mamba_ngroups": 2,
            "num_mem_blocks": 2,
            "use_shared_attention_adapter": True,
            "adapter_rank": 8,
            "use_mem_rope": True,
        },
    ),
    "odd": (  # one block, no attention adapters, no RoPE, GQA, hybrid first
        1,
        {
            **COMMON,
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 5,
            "layers_block_type": [H, L, L, H, L],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "n_mamba_heads": 6,
            "mamba_ngroups": 3,
            "mamba_d_state": 8,
            "num_mem_blocks": 1,
            "adapter_rank": 4,
        },
    ),
    "three_blocks": (  # 4 hybrid layers over 3 blocks: the 4th wraps back to block 0
        2,
        {
            **COMMON,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 5,
            "layers_block_type": [H, H, L, H, H],
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_mamba_heads": 4,
            "num_mem_blocks": 3,
            "use_shared_attention_adapter": True,
            "adapter_rank": 4,
            "use_mem_rope": True,
            "hidden_act": "silu",
        },
    ),
}


def build_zamba2(name: str, model_dir: Path) -> tuple[Any, LoadedModel]:
    seed, config = VARIANTS[name]
    hf = make_hf("zamba2", config, seed=seed)
    return hf, load_model(save_checkpoint(hf, model_dir), "float32")


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_zamba2(request.param, tmp_path_factory.mktemp(f"zamba2_{request.param}"))


class TestZamba2(TransformersChecks):
    """Prefill, greedy decode, chunked prefill and batching against transformers."""


def test_each_hybrid_layer_attends_over_its_own_kv_cache(tiny: tuple[Any, Any]) -> None:
    """One PagedAttention per hybrid layer, on the attention cache the core gave that layer."""
    hf, lm = tiny
    attn_layers = [m.layer_index for m in lm.model.modules() if isinstance(m, PagedAttention)]
    spec_layers = [c.layer_index for c in lm.spec.layers if c.name == "attn"]
    assert attn_layers == spec_layers == hf.config.hybrid_layer_ids


def test_shared_weights_are_one_parameter_per_block(tiny: tuple[Any, Any]) -> None:
    hf, lm = tiny
    blocks, ids = int(hf.config.num_mem_blocks), hf.config.hybrid_layer_ids
    layers = lm.model.model.layers
    for c, i in enumerate(ids):
        first = layers[ids[c % blocks]].shared_transformer
        mine = layers[i].shared_transformer
        assert mine.self_attn.q_proj.base.weight is first.self_attn.q_proj.base.weight
        assert mine.feed_forward.down_proj.weight is first.feed_forward.down_proj.weight
        if c >= blocks:  # adapters are per invocation, never shared
            adapter = mine.feed_forward.gate_up_proj.adapter
            assert adapter[0].weight is not first.feed_forward.gate_up_proj.adapter[0].weight


def write_repeated_form(model_dir: Path, out_dir: Path) -> dict[str, torch.Tensor]:
    """Copy of the checkpoint with every hybrid layer holding its block's full tensors."""
    config = json.loads((model_dir / "config.json").read_text())
    ids, blocks = config["hybrid_layer_ids"], config["num_mem_blocks"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    for c, i in enumerate(ids):
        src = f"model.layers.{ids[c % blocks]}.shared_transformer."
        for name in [n for n in tensors if n.startswith(src)]:
            tensors[name.replace(src, f"model.layers.{i}.shared_transformer.")] = tensors[name]
    out_dir.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
    repeated = {n: t.clone().contiguous() for n, t in tensors.items()}
    save_file(repeated, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return repeated


def test_block_repeated_under_every_hybrid_layer_loads(tmp_path: Path) -> None:
    hf, single = build_zamba2("two_blocks", tmp_path / "single")
    repeated = write_repeated_form(tmp_path / "single", tmp_path / "repeated")
    assert "model.layers.4.shared_transformer.self_attn.q_proj.weight" in repeated
    lm = load_model(tmp_path / "repeated", "float32")
    got, ref = lm.model.state_dict(), single.model.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    ids = prompt(1, 20)
    logits = PagedRunner(lm.model, lm.spec).step([("a", ids)], all_logits=True)
    assert_close(logits, hf_logits(hf, ids))


def test_repeated_copies_that_differ_are_rejected(tmp_path: Path) -> None:
    build_zamba2("two_blocks", tmp_path / "single")
    repeated = write_repeated_form(tmp_path / "single", tmp_path / "repeated")
    name = "model.layers.4.shared_transformer.self_attn.o_proj.weight"
    repeated[name] = repeated[name] + 1e-3
    save_file(repeated, str(tmp_path / "repeated" / "model.safetensors"))
    with pytest.raises(ValueError, match="differs from another copy"):
        load_model(tmp_path / "repeated", "float32")
