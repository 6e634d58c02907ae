"""Bamba (``bamba``): Mamba2 layers with a few RoPE attention layers, a SwiGLU MLP in each.

Also the Mamba2 pieces that NemotronH and GraniteMoeHybrid share: building a
:class:`~hybridkv.layers.mamba2.Mamba2Mixer` from the layer's cache spec, and finding which
layers are recurrent. Which layer is attention comes from the ModelSpec
(``attn_layer_indices`` / ``layer_types`` are read once, by ``hybridkv.core``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.core.spec import ModelSpec, RecurrentStateSpec
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.mamba2 import Mamba2Config, Mamba2Mixer, parse_dt_limit
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.norm import RMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.models.common import PreNormDecoderLayer, attention_config_from, hybrid_layers


def state_specs(spec: ModelSpec) -> dict[int, RecurrentStateSpec]:
    """Layer index -> its recurrent state spec, for the layers that hold one."""
    return {
        c.layer_index: c.spec
        for c in spec.layers
        if c.name == "state" and isinstance(c.spec, RecurrentStateSpec)
    }


def mamba2_mixer(
    cfg: Mapping[str, Any], state: RecurrentStateSpec, layer_index: int, **options: Any
) -> Mamba2Mixer:
    """A Mamba2 mixer under the Bamba/Granite key names; ``options`` override them."""
    settings: dict[str, Any] = {
        "hidden_size": int(cfg["hidden_size"]),
        "chunk_size": int(cfg.get("mamba_chunk_size", 256)),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "activation": str(cfg.get("hidden_act", "silu")),
        "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "proj_bias": bool(cfg.get("mamba_proj_bias", False)),
        "dt_limit": parse_dt_limit(cfg.get("time_step_limit")),
    }
    return Mamba2Mixer(Mamba2Config.from_spec(state, **{**settings, **options}), layer_index)


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
