"""LFM2 (``lfm2``, ``lfm2_moe``): gated short-conv layers and attention layers with q/k RMSNorm.

Every layer is ``x + mixer(operator_norm(x))`` then ``x + feed_forward(ffn_norm(x))``; the
mixer is a :class:`~hybridkv.layers.short_conv.ShortConv` or attention, as the ModelSpec
says (``layer_types`` or the legacy ``full_attn_idxs``). The final norm is called
``embedding_norm`` in the checkpoints, and the attention's ``out_proj`` / ``q_layernorm`` /
``k_layernorm`` are renamed to :class:`~hybridkv.layers.attention.PagedAttention`'s names.

LFM2-MoE keeps the first ``num_dense_layers`` feed-forwards dense (at ``intermediate_size``,
without LFM2's auto-adjust) and routes the others over experts with sigmoid scores; a
per-expert bias, learned for load balancing, steers only which experts are picked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.moe import SparseMoE
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.short_conv import ShortConv
from hybridkv.models.base import CausalLM
from hybridkv.models.common import PreNormDecoderLayer, attention_config_from, hybrid_layers

_RENAMES = (
    ("model.embedding_norm.", "model.norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)
_EXPERT_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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
    return attention_config_from(
        cfg,
        qk_norm=RMSNorm,
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        bias=False,  # Lfm2Attention has no projection bias
    )


class Lfm2DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block; the mixer sits under ``conv`` or ``self_attn`` as in the checkpoints."""

    recurrent_name = "conv"
    norm_names = ("operator_norm", "ffn_norm")


class Lfm2ForCausalLM(CausalLM):
    """Dense LFM2; :meth:`make_feed_forward` is the hook for the MoE variant."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("norm_eps", 1e-5))
        kernel, bias = int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False))
        layers = hybrid_layers(
            spec,
            recurrent=lambda i: ShortConv(hidden, kernel, bias, i),
            attention=lambda i: PagedAttention(lfm2_attention_config(cfg), i),
            decoder_layer=lambda mixer, i: Lfm2DecoderLayer(
                mixer, self.make_feed_forward(i), hidden, eps
            ),
        )
        self.build_model(layers, RMSNorm(hidden, eps))

    def make_feed_forward(self, layer_index: int) -> nn.Module:
        return Lfm2MLP(int(self.cfg["hidden_size"]), lfm2_ff_size(self.cfg))

    def remap_weight_name(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name


class SigmoidRouterMoE(SparseMoE):
    """LFM2-MoE's sparse block: :class:`SparseMoE` with ``Lfm2MoeTopKRouter``'s routing.

    Scores are ``sigmoid(gate(x))``; the top-k are chosen on ``scores + expert_bias`` (an fp32
    buffer) but weighted by the unbiased scores, renormalised with a 1e-6 guard when
    ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.
    """

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__(
            int(cfg["hidden_size"]),
            int(cfg["moe_intermediate_size"]),
            int(cfg["num_experts"]),
            int(cfg["num_experts_per_tok"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )
        self.scaling = float(cfg.get("routed_scaling_factor") or 1.0)
        use_bias = bool(cfg.get("use_expert_bias", True))
        bias = torch.zeros(int(cfg["num_experts"])) if use_bias else None
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", bias)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = self.gate(x)  # [T, E]
        scores = logits.sigmoid()
        if self.expert_bias is not None:
            experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
            weights = scores.gather(1, experts).type_as(logits)  # [T, k]
        else:
            weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.scaling, experts


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """``lfm2_moe``: dense feed-forwards below ``num_dense_layers``, routed experts above."""

    def make_feed_forward(self, layer_index: int) -> nn.Module:
        if layer_index < int(self.cfg.get("num_dense_layers", 2)):
            return Lfm2MLP(int(self.cfg["hidden_size"]), int(self.cfg["intermediate_size"]))
        return SigmoidRouterMoE(self.cfg)

    def remap_weight_name(self, name: str) -> str | None:
        """Experts are ``experts.N.{w1,w3,w2}`` on disk, :class:`GatedMLP` names here."""
        renamed = super().remap_weight_name(name)
        if renamed is None or ".feed_forward.experts." not in renamed:
            return renamed
        head, leaf, kind = renamed.rsplit(
            ".", 2
        )  # model.layers.i.feed_forward.experts.N, w1, weight
        return f"{head}.{_EXPERT_RENAMES.get(leaf, leaf)}.{kind}"

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Expert biases are fp32 buffers: copy them aside, the parameters by name.

        Raises:
            KeyError: as :meth:`CausalLM.load_weights`, and for a missing or unknown bias.
        """
        buffers = {n: b for n, b in self.named_buffers() if n.endswith(".expert_bias")}
        seen: set[str] = set()

        def parameters_only() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                if not name.endswith(".expert_bias"):
                    yield name, tensor
                    continue
                if name not in buffers:
                    raise KeyError(f"checkpoint tensor {name!r} matches no expert bias")
                buffers[name].copy_(tensor.float())
                seen.add(name)

        super().load_weights(parameters_only())
        if set(buffers) - seen:
            raise KeyError(f"checkpoint has no tensor for {sorted(set(buffers) - seen)[:8]}")
