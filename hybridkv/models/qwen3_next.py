"""Qwen3-Next (``qwen3_next``): Gated DeltaNet + gated attention, MoE with a shared expert.

Also the shared pieces of Qwen3.5 (:mod:`hybridkv.models.qwen3_5`): the decoder layer, the
attention and GDN configs, and the checkpoint name rules (VLM prefix, vision tower, MTP head).
Which layer is attention and which is GDN comes from the ModelSpec (``model_config`` is the
one reader of ``layer_types`` / ``full_attention_interval``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.gated_deltanet import GatedDeltaNet, GDNConfig, Qwen3NextGatedDeltaNet
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.moe import SparseMoE
from hybridkv.layers.norm import ZeroCenteredRMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.models.common import PreNormDecoderLayer, attention_config_from, hybrid_layers

_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
_GROUPED_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")  # rows grouped per k-head on disk


def attention_config(cfg: Mapping[str, Any]) -> AttentionConfig:
    return attention_config_from(
        cfg,
        qk_norm=ZeroCenteredRMSNorm,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        output_gate=bool(cfg.get("attn_output_gate", True)),
    )


def gdn_config(cfg: Mapping[str, Any]) -> GDNConfig:
    return GDNConfig(
        hidden_size=int(cfg["hidden_size"]),
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


def moe_block(cfg: Mapping[str, Any], norm_topk_prob: bool) -> SparseMoE:
    return SparseMoE(
        int(cfg["hidden_size"]),
        int(cfg["moe_intermediate_size"]),
        int(cfg["num_experts"]),
        int(cfg["num_experts_per_tok"]),
        norm_topk_prob=norm_topk_prob,
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
        act=str(cfg.get("hidden_act", "silu")),
    )


class QwenHybridDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``.

    The mixer sits under the checkpoint's name: ``linear_attn`` (GDN) or ``self_attn``.
    """

    recurrent_name = "linear_attn"
    feed_forward_name = "mlp"
    norm_names = ("input_layernorm", "post_attention_layernorm")
    norm_class = ZeroCenteredRMSNorm


class QwenHybridForCausalLM(CausalLM):
    """Qwen3-Next and Qwen3.5 share everything but the GDN projections and the MLP rule."""

    gdn_class: type[GatedDeltaNet] = Qwen3NextGatedDeltaNet

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        layers = hybrid_layers(
            spec,
            recurrent=lambda i: self.gdn_class(gdn_config(cfg), i),
            attention=lambda i: PagedAttention(attention_config(cfg), i),
            decoder_layer=lambda mixer, i: QwenHybridDecoderLayer(
                mixer, self.make_mlp(i), hidden, eps
            ),
        )
        self.build_model(layers, ZeroCenteredRMSNorm(hidden, eps))

    def make_mlp(self, layer_index: int) -> nn.Module:
        """Qwen3-Next: MoE every ``decoder_sparse_step`` layers unless in ``mlp_only_layers``."""
        cfg = self.cfg
        num_experts = int(cfg.get("num_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        if (
            num_experts > 0
            and layer_index not in (cfg.get("mlp_only_layers") or [])
            and (layer_index + 1) % step == 0
        ):
            return moe_block(cfg, bool(cfg.get("norm_topk_prob", True)))
        return self.dense_mlp()

    def dense_mlp(self) -> GatedMLP:
        cfg = self.cfg
        return GatedMLP(
            int(cfg["hidden_size"]),
            int(cfg["intermediate_size"]),
            str(cfg.get("hidden_act", "silu")),
        )

    def remap_weight_name(self, name: str) -> str | None:
        """VLM checkpoints keep the LM under ``model.language_model.``; skip vision and MTP."""
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name


class Qwen3NextForCausalLM(QwenHybridForCausalLM):
    """``qwen3_next``: fused ``in_proj_qkvz`` / ``in_proj_ba`` GDN projections, their rows
    reordered from the checkpoint's per-k-head groups as they load."""

    gdn_class = Qwen3NextGatedDeltaNet

    def split_weight(self, name: str, tensor: Tensor) -> Iterable[tuple[str, Tensor]]:
        prefix, _, leaf = name.rpartition(".")
        mixer_name, _, projection = prefix.rpartition(".")
        if leaf == "weight" and projection in _GROUPED_PROJECTIONS:
            mixer = self.get_submodule(mixer_name)
            if isinstance(mixer, Qwen3NextGatedDeltaNet):
                tensor = mixer.flat_rows(projection, tensor)
        yield name, tensor
