"""Bamba (``bamba``): Mamba2 layers with a few RoPE attention layers, a SwiGLU MLP in each.

Also the Mamba2 pieces that NemotronH and GraniteMoeHybrid share: building a
:class:`~hybridkv.layers.mamba2.Mamba2Mixer` from the layer's cache spec, and finding which
layers are recurrent. Which layer is attention comes from the ModelSpec
(``attn_layer_indices`` / ``layer_types`` are read once, by ``hybridkv.core``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec, RecurrentStateSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.mamba2 import Mamba2Config, Mamba2Mixer, parse_dt_limit
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.rope import rope_settings
from hybridkv.models.base import CausalLM, DecoderStack
from hybridkv.models.batch import ForwardBatch
from hybridkv.models.cache import CacheViews


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


def rope_attention_config(cfg: Mapping[str, Any], **options: Any) -> AttentionConfig:
    """Llama-style GQA attention with RoPE (partial when ``partial_rotary_factor`` says so)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rotary_dim, theta = rope_settings(cfg, head_dim)
    settings: dict[str, Any] = {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "rope_theta": theta,
        "bias": bool(cfg.get("attention_bias", False)),
    }
    return AttentionConfig(**{**settings, **options})


class BambaDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + feed_forward(norm(x))``; mixer named as on disk."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.mixer_name = "mamba" if isinstance(mixer, Mamba2Mixer) else "self_attn"
        self.add_module(self.mixer_name, mixer)
        self.feed_forward = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(self.input_layernorm(x), batch, views)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaForCausalLM(CausalLM):
    """``bamba``: the final norm is ``model.final_layernorm`` on disk."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        states = state_specs(spec)
        layers = []
        for i in range(spec.num_layers):
            mixer: nn.Module
            if i in states:
                mixer = mamba2_mixer(cfg, states[i], i)
            else:
                mixer = PagedAttention(rope_attention_config(cfg), i)
            mlp = GatedMLP(
                hidden,
                int(cfg["intermediate_size"]),
                str(cfg.get("hidden_act", "silu")),
                bias=bool(cfg.get("mlp_bias", False)),
            )
            layers.append(BambaDecoderLayer(mixer, mlp, hidden, eps))
        vocab = int(cfg["vocab_size"])
        self.model = DecoderStack(vocab, hidden, layers, RMSNorm(hidden, eps))
        self.finish_init(vocab, hidden)

    def remap_weight_name(self, name: str) -> str | None:
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name.removeprefix("model.final_layernorm.")
        return name
