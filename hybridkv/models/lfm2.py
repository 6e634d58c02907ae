"""LFM2 (``lfm2``): gated short-conv layers and attention layers with q/k RMSNorm.

Every layer is ``x + mixer(operator_norm(x))`` then ``x + feed_forward(ffn_norm(x))``; the
mixer is a :class:`~hybridkv.layers.short_conv.ShortConv` or attention, as the ModelSpec
says (``layer_types`` or the legacy ``full_attn_idxs``). The final norm is called
``embedding_norm`` in the checkpoints, and the attention's ``out_proj`` / ``q_layernorm`` /
``k_layernorm`` are renamed to :class:`~hybridkv.layers.attention.PagedAttention`'s names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.rope import rope_settings
from hybridkv.layers.short_conv import ShortConv
from hybridkv.models.base import CausalLM, DecoderStack
from hybridkv.models.batch import ForwardBatch
from hybridkv.models.cache import CacheViews

_RENAMES = (
    ("model.embedding_norm.", "model.norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)


def lfm2_ff_size(cfg: Mapping[str, Any]) -> int:
    """The feed-forward width after LFM2's ``block_auto_adjust_ff_dim`` rule."""
    size = int(cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(cfg.get("block_multiple_of", 256))
        size = int(float(multiplier) * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2MLP(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``, named as the checkpoints."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def lfm2_attention_config(cfg: Mapping[str, Any]) -> AttentionConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rotary_dim, theta = rope_settings(cfg, head_dim)
    return AttentionConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        qk_norm=RMSNorm,
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
    )


class Lfm2DecoderLayer(nn.Module):
    """Pre-norm block; the mixer sits under ``conv`` or ``self_attn`` as in the checkpoints."""

    def __init__(self, mixer: nn.Module, feed_forward: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.mixer_name = "conv" if isinstance(mixer, ShortConv) else "self_attn"
        self.add_module(self.mixer_name, mixer)
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(hidden, eps)
        self.ffn_norm = RMSNorm(hidden, eps)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        x = x + getattr(self, self.mixer_name)(self.operator_norm(x), batch, views)
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2ForCausalLM(CausalLM):
    """Dense LFM2; :meth:`make_feed_forward` is the hook for the MoE variant."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("norm_eps", 1e-5))
        recurrent = {c.layer_index for c in spec.layers if c.name == "state"}
        kernel, bias = int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False))
        layers = []
        for i in range(spec.num_layers):
            mixer: nn.Module
            if i in recurrent:
                mixer = ShortConv(hidden, kernel, bias, i)
            else:
                mixer = PagedAttention(lfm2_attention_config(cfg), i)
            layers.append(Lfm2DecoderLayer(mixer, self.make_feed_forward(i), hidden, eps))
        vocab = int(cfg["vocab_size"])
        self.model = DecoderStack(vocab, hidden, layers, RMSNorm(hidden, eps))
        self.finish_init(vocab, hidden)

    def make_feed_forward(self, layer_index: int) -> nn.Module:
        return Lfm2MLP(int(self.cfg["hidden_size"]), lfm2_ff_size(self.cfg))

    def remap_weight_name(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
