"""Jamba (``jamba``): Mamba1 layers with dt/B/C norms, attention without RoPE, MoE FFNs.

Layer ``i`` is attention iff ``i % attn_layer_period == attn_layer_offset`` (read by the
core into the ModelSpec) and routes its FFN through ``num_experts`` experts iff
``i % expert_layer_period == expert_layer_offset``. The router is a softmax top-k whose
weights are *not* renormalised. Checkpoint names: ``mamba`` / ``self_attn`` mixers,
``feed_forward.router`` (renamed to the MoE's ``gate``), ``final_layernorm``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.mamba1 import Mamba1Config, Mamba1Mixer
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.moe import SparseMoE
from hybridkv.layers.norm import RMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.models.common import PreNormDecoderLayer, attention_config_from, hybrid_layers

_RENAMES = (
    ("model.final_layernorm.", "model.norm."),
    (".feed_forward.router.", ".feed_forward.gate."),
)


def jamba_mamba_config(cfg: Mapping[str, Any]) -> Mamba1Config:
    hidden = int(cfg["hidden_size"])
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    return Mamba1Config(
        hidden_size=hidden,
        inner_size=int(cfg.get("mamba_expand", 2)) * hidden,
        d_state=int(cfg.get("mamba_d_state", 16)),
        dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_bc_norm=True,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation=str(cfg.get("hidden_act", "silu")),
    )


def jamba_attention_config(cfg: Mapping[str, Any]) -> AttentionConfig:
    return attention_config_from(cfg, rope=False, bias=False)  # JambaAttention: no RoPE, no bias


class JambaDecoderLayer(PreNormDecoderLayer):
    """``x + mixer(input_layernorm(x))``, then ``x + feed_forward(pre_ff_layernorm(x))``."""


class JambaForCausalLM(CausalLM):
    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        layers = hybrid_layers(
            spec,
            recurrent=lambda i: Mamba1Mixer(jamba_mamba_config(cfg), i),
            attention=lambda i: PagedAttention(jamba_attention_config(cfg), i),
            decoder_layer=lambda mixer, i: JambaDecoderLayer(
                mixer, self.make_feed_forward(i), hidden, eps
            ),
        )
        self.build_model(layers, RMSNorm(hidden, eps))

    def make_feed_forward(self, layer_index: int) -> nn.Module:
        cfg = self.cfg
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        act = str(cfg.get("hidden_act", "silu"))
        num_experts = int(cfg.get("num_experts", 16))
        period, offset = (
            int(cfg.get("expert_layer_period", 2)),
            int(cfg.get("expert_layer_offset", 1)),
        )
        if num_experts > 1 and layer_index % period == offset:
            top_k = int(cfg.get("num_experts_per_tok", 2))
            return SparseMoE(hidden, inter, num_experts, top_k, norm_topk_prob=False, act=act)
        return GatedMLP(hidden, inter, act)

    def remap_weight_name(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
