"""Bamba (``bamba``): Mamba2 layers with a few RoPE attention layers, a SwiGLU MLP in each.

Which layer is attention comes from the ModelSpec (``attn_layer_indices`` / ``layer_types``
are read once, by ``hybridkv.core``); the Mamba2 mixer is :func:`.common.mamba2_mixer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.norm import RMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.models.common import (
    PreNormDecoderLayer,
    attention_config_from,
    hybrid_layers,
    mamba2_mixer,
    state_specs,
)


class BambaDecoderLayer(PreNormDecoderLayer):
    """``x + mixer(norm(x))``, then ``x + feed_forward(norm(x))``; mixer named as on disk."""


class BambaForCausalLM(CausalLM):
    """``bamba``: the final norm is ``model.final_layernorm`` on disk."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        states = state_specs(spec)
        layers = hybrid_layers(
            spec,
            recurrent=lambda i: mamba2_mixer(cfg, states[i], i),
            attention=lambda i: PagedAttention(attention_config_from(cfg), i),
            decoder_layer=lambda mixer, i: BambaDecoderLayer(mixer, self._mlp(), hidden, eps),
        )
        self.build_model(layers, RMSNorm(hidden, eps))

    def _mlp(self) -> GatedMLP:
        cfg = self.cfg
        return GatedMLP(
            int(cfg["hidden_size"]),
            int(cfg["intermediate_size"]),
            str(cfg.get("hidden_act", "silu")),
            bias=bool(cfg.get("mlp_bias", False)),
        )

    def remap_weight_name(self, name: str) -> str | None:
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name.removeprefix("model.final_layernorm.")
        return name
