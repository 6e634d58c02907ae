"""Qwen3.5 (``qwen3_5``, ``qwen3_5_text``) and Qwen3.5-MoE (``qwen3_5_moe[_text]``).

Same blocks as Qwen3-Next (:mod:`hybridkv.models.qwen3_next`) with flat GDN projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). The dense model has a plain
MLP in every layer; the MoE model a top-k (always renormalised) MoE with a shared expert in
every layer. Real checkpoints are VLMs; the vision tower is skipped on load and text
positions make the multimodal RoPE plain RoPE.
"""

from __future__ import annotations

from torch import nn

from hybridkv.layers.gated_deltanet import Qwen35GatedDeltaNet
from hybridkv.models.qwen3_next import QwenHybridForCausalLM, moe_block


class Qwen35ForCausalLM(QwenHybridForCausalLM):
    """Dense Qwen3.5."""

    gdn_class = Qwen35GatedDeltaNet

    def make_mlp(self, layer_index: int) -> nn.Module:
        return self.dense_mlp()


class Qwen35MoeForCausalLM(QwenHybridForCausalLM):
    """Qwen3.5-MoE: every layer routes (norm_topk_prob is always on in transformers)."""

    gdn_class = Qwen35GatedDeltaNet

    def make_mlp(self, layer_index: int) -> nn.Module:
        return moe_block(self.cfg, norm_topk_prob=True)
