"""GraniteMoeHybrid (``granitemoehybrid``, Granite 4.0-H): Mamba2 + attention, MoE + shared MLP.

Granite's muP-style scalars, each where transformers applies it::

    h   = embed(ids) * embedding_multiplier
    h   = h + residual_multiplier * mixer(norm(h))        # attention scale: attention_multiplier
    h   = h + residual_multiplier * (moe(norm(h)) + shared_mlp(norm(h)))
    out = lm_head(norm(h)) / logits_scaling

Attention uses RoPE only when ``position_embedding_type == "rope"`` (Granite 4.0-H: "nope").
The MoE softmaxes the top-k router logits; experts are stored fused on disk
(``input_linear.weight`` [E, 2I, H] as [gate | up], ``output_linear.weight`` [E, H, I]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.layers.mlp import activation
from hybridkv.layers.moe import GroupedExperts, moe_forward
from hybridkv.layers.norm import RMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.models.common import attention_config_from, hybrid_layers, mamba2_mixer, state_specs

_EXPERT_NAMES = (
    ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
    ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
)


class SharedMLP(nn.Module):
    """``output_linear(act(gate) * up)`` with ``[gate | up] = input_linear(x)``."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class Router(nn.Module):
    """``router.layer``: a linear map to expert logits."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k routing, softmax over the chosen logits, SwiGLU experts.

    The checkpoint's fused ``input_linear.weight`` [E, 2I, H] ([gate | up]) and
    ``output_linear.weight`` [E, H, I] are the experts' stacked weights as they are.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.top_k = top_k
        self.router = Router(hidden, num_experts)
        self.experts = GroupedExperts(num_experts, hidden, intermediate, activation(act))

    def forward(self, x: Tensor) -> Tensor:
        logits = self.router.layer(x).float()  # [T, E]
        top_logits, experts = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1).type_as(x)
        return moe_forward(x, weights, experts, self.experts)


class GraniteMoeHybridDecoderLayer(nn.Module):
    """Pre-norm block with the residual branches scaled by ``residual_multiplier``."""

    def __init__(
        self, mixer: nn.Module, moe: GraniteMoE | None, shared: SharedMLP, cfg: Mapping[str, Any]
    ) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.mixer_name = "mamba" if isinstance(mixer, Mamba2Mixer) else "self_attn"
        self.add_module(self.mixer_name, mixer)
        self.block_sparse_moe = moe
        self.shared_mlp = shared
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(self.input_layernorm(x), batch, views) * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = self.block_sparse_moe(h) + ffn
        return x + ffn * self.residual_multiplier


class GraniteMoeHybridForCausalLM(CausalLM):
    """``granitemoehybrid``; ``num_local_experts == 0`` gives the dense variant."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(cfg.get("logits_scaling", 1.0))
        states = state_specs(spec)
        layers = hybrid_layers(
            spec,
            recurrent=lambda i: mamba2_mixer(cfg, states[i], i),
            attention=self._attention,
            decoder_layer=lambda mixer, i: GraniteMoeHybridDecoderLayer(
                mixer,
                self._moe(),
                SharedMLP(hidden, int(cfg["shared_intermediate_size"]), self._act),
                cfg,
            ),
        )
        self.build_model(layers, RMSNorm(hidden, eps))

    @property
    def _act(self) -> str:
        return str(self.cfg.get("hidden_act", "silu"))

    def _attention(self, index: int) -> PagedAttention:
        cfg = self.cfg
        options: dict[str, Any] = {"scale": float(cfg.get("attention_multiplier", 1.0))}
        if cfg.get("position_embedding_type") != "rope":
            options["rotary_dim"] = 0
        return PagedAttention(attention_config_from(cfg, **options), index)

    def _moe(self) -> GraniteMoE | None:
        cfg = self.cfg
        num_experts = int(cfg.get("num_local_experts") or 0)
        if num_experts == 0:
            return None
        return GraniteMoE(
            int(cfg["hidden_size"]),
            int(cfg["intermediate_size"]),
            num_experts,
            int(cfg["num_experts_per_tok"]),
            self._act,
        )

    def remap_weight_name(self, name: str) -> str | None:
        """The fused expert weights are :class:`GroupedExperts`' stacked parameters."""
        for old, new in _EXPERT_NAMES:
            if name.endswith(old):
                return name.removesuffix(old) + new
        return name

    def embed(self, batch: ForwardBatch) -> Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return (self.lm_head(hidden) / self.logits_scaling).float()
