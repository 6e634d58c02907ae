"""What the hybrid architectures build the same way: the attention config, the Mamba2 mixer
(Bamba, NemotronH, GraniteMoeHybrid, Zamba2), the pre-norm decoder layer and the loop that
puts a recurrent mixer or attention in each layer.

Each architecture keeps only what differs: its config keys, its norm class and its
checkpoint names (class attributes of :class:`PreNormDecoderLayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec, RecurrentStateSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.mamba2 import Mamba2Config, Mamba2Mixer, parse_dt_limit
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.rope import rope_settings


def attention_config_from(
    cfg: Mapping[str, Any], *, rope: bool = True, head_dim: int | None = None, **options: Any
) -> AttentionConfig:
    """GQA attention read from an HF config the way transformers' Llama-style models do.

    ``num_attention_heads`` heads, ``num_key_value_heads`` (or as many) KV heads,
    ``head_dim`` (or ``hidden_size // heads``) per head, ``attention_bias`` on the
    projections, and RoPE as :func:`~hybridkv.layers.rope.rope_settings` reads it unless
    ``rope`` is False (Jamba, NemotronH). ``head_dim`` given here wins over the config's;
    ``options`` set or override any other :class:`AttentionConfig` field.
    """
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if head_dim is None:
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    settings: dict[str, Any] = {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "bias": bool(cfg.get("attention_bias", False)),
    }
    if rope:
        settings["rotary_dim"], settings["rope_theta"] = rope_settings(cfg, head_dim)
    return AttentionConfig(**{**settings, **options})


def hybrid_layers(
    spec: ModelSpec,
    recurrent: Callable[[int], nn.Module],
    attention: Callable[[int], nn.Module],
    decoder_layer: Callable[[nn.Module, int], nn.Module],
) -> list[nn.Module]:
    """One decoder layer per layer index, around ``recurrent(i)`` where the ModelSpec puts a
    recurrent state and ``attention(i)`` elsewhere; built in layer order, mixer first."""
    states = {c.layer_index for c in spec.layers if c.name == "state"}
    return [
        decoder_layer(recurrent(i) if i in states else attention(i), i)
        for i in range(spec.num_layers)
    ]


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


class PreNormDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + feed_forward(norm(x))``, under the checkpoint's names.

    Subclasses name the recurrent mixer (attention is always ``self_attn``), the feed-forward
    and the two norms as their checkpoints do, and pick the norm class.
    """

    recurrent_name: ClassVar[str] = "mamba"
    feed_forward_name: ClassVar[str] = "feed_forward"
    norm_names: ClassVar[tuple[str, str]] = ("input_layernorm", "pre_ff_layernorm")
    norm_class: ClassVar[Callable[[int, float], nn.Module]] = RMSNorm

    def __init__(self, mixer: nn.Module, feed_forward: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.mixer_name = "self_attn" if isinstance(mixer, PagedAttention) else self.recurrent_name
        self.add_module(self.mixer_name, mixer)
        self.add_module(self.feed_forward_name, feed_forward)
        for name in self.norm_names:
            self.add_module(name, self.norm_class(hidden, eps))

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        mixer_norm, ff_norm = (getattr(self, name) for name in self.norm_names)
        x = x + getattr(self, self.mixer_name)(mixer_norm(x), batch, views)
        return x + getattr(self, self.feed_forward_name)(ff_norm(x))
