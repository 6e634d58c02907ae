"""What the hybrid architectures build the same way: the attention config, the pre-norm
decoder layer and the loop that puts a recurrent mixer or attention in each layer.

Each architecture keeps only what differs: its config keys, its norm class and its
checkpoint names (class attributes of :class:`PreNormDecoderLayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.rope import rope_settings
from hybridkv.models.batch import ForwardBatch
from hybridkv.models.cache import CacheViews


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
