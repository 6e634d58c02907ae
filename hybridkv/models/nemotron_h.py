"""NemotronH (``nemotron_h``): one mixer per block: Mamba2 M, attention *, MLP -, MoE E.

Every block is ``x + mixer(norm(x))``; only ``M`` and ``*`` blocks hold a cache. Attention
has no positional encoding. The MLP is ``down(relu(up(x))^2)`` without a gate; the MoE
(Nemotron-3) routes with sigmoid scores, a per-expert correction bias and group-limited
top-k, and adds a shared expert. Checkpoints keep the model under ``backbone.``.

Mamba2's ``dt`` is clamped to ``>= time_step_min`` in multi-token chunks only, exactly as
transformers does (its one-token step, like mamba_ssm's, has no clamp). So a one-token
prefill chunk, which takes the step path, can differ slightly from the same token inside a
longer chunk when ``softplus(dt) < time_step_min``; NemotronH's dt_bias init sits near there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.moe import GroupedExperts, moe_forward
from hybridkv.layers.norm import rms_normalize
from hybridkv.models.base import CausalLM
from hybridkv.models.common import attention_config_from, mamba2_mixer, state_specs
from hybridkv.ops.row_blocks import by_row_blocks

_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_WORDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def block_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each block's mixer: ``hybrid_override_pattern`` (legacy) or ``layers_block_type``."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        return [_LETTERS[c] for c in pattern]
    return [_WORDS[w] for w in cfg.get("layers_block_type") or cfg["layer_types"]]


class Fp32RMSNorm(nn.Module):
    """NemotronH's RMSNorm: the weight multiplies in fp32, one cast at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return by_row_blocks(self._norm, x)

    def _norm(self, x: Tensor) -> Tensor:
        h = x.float()
        h = rms_normalize(h, self.eps)
        return (self.weight.float() * h).to(x.dtype)


def relu_squared(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x))^2)``: NemotronH's dense MLP, experts and shared expert."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


class GroupLimitedRouter(nn.Module):
    """Sigmoid scores; pick ``topk_group`` groups by their top-2 biased scores, then top-k.

    The correction bias steers only the choice; the weights are the unbiased scores,
    renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``.
    """

    def __init__(self, cfg: Mapping[str, Any], hidden: int) -> None:
        super().__init__()
        self.num_experts = int(cfg["n_routed_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.num_groups = int(cfg.get("n_group") or 1)
        self.topk_group = int(cfg.get("topk_group") or 1)
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.scaling = float(cfg.get("routed_scaling_factor") or 1.0)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
        chosen = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
        experts = biased.masked_fill(~keep, -torch.inf).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class NemotronHMoE(nn.Module):
    """Routed relu² experts (optionally in a latent space) plus a shared expert."""

    def __init__(self, cfg: Mapping[str, Any], hidden: int) -> None:
        super().__init__()
        bias = bool(cfg.get("mlp_bias", False))
        latent = cfg.get("moe_latent_size")
        width = int(latent) if latent else hidden
        self.gate = GroupLimitedRouter(cfg, hidden)
        self.experts = GroupedExperts(
            self.gate.num_experts,
            width,
            int(cfg["moe_intermediate_size"]),
            relu_squared,
            gated=False,
            bias=bias,
        )
        self.shared_experts = ReluSquaredMLP(
            hidden, int(cfg["moe_shared_expert_intermediate_size"]), bias
        )
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if latent:
            self.fc1_latent_proj = nn.Linear(hidden, width, bias=bias)
            self.fc2_latent_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.gate(x)  # [T, k]
        h = self.fc1_latent_proj(x)  # [T, width]
        routed = moe_forward(h, weights, experts, self.experts, sum_dtype=torch.float32)
        return self.fc2_latent_proj(routed.to(x.dtype)) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))`` with one mixer of the four kinds."""

    def __init__(self, mixer: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.mixer = mixer
        self.norm = Fp32RMSNorm(hidden, eps)
        self.has_cache = not isinstance(mixer, (ReluSquaredMLP, NemotronHMoE))

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        h = self.norm(x)
        return x + (self.mixer(h, batch, views) if self.has_cache else self.mixer(h))


class NemotronHForCausalLM(CausalLM):
    """``nemotron_h``."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("layer_norm_epsilon", 1e-5))
        states = state_specs(spec)
        layers = [
            NemotronHBlock(self._mixer(kind, i, states), hidden, eps)
            for i, kind in enumerate(block_types(cfg))
        ]
        self.build_model(layers, Fp32RMSNorm(hidden, eps))

    def _mixer(self, kind: str, index: int, states: dict) -> nn.Module:
        cfg, hidden = self.cfg, int(self.cfg["hidden_size"])
        if kind == "mamba":
            return mamba2_mixer(
                cfg,
                states[index],
                index,
                chunk_size=int(cfg.get("chunk_size", 128)),
                norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                activation=str(cfg.get("mamba_hidden_act", "silu")),
                conv_bias=bool(cfg.get("use_conv_bias", True)),
                proj_bias=bool(cfg.get("use_bias", False)),
                dt_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
                clamp_dt_in_step=False,
            )
        if kind == "attention":  # NemotronHAttention here: no positional encoding, no bias
            return PagedAttention(attention_config_from(cfg, rope=False, bias=False), index)
        if kind == "moe":
            return NemotronHMoE(cfg, hidden)
        intermediate = int(cfg["intermediate_size"])
        return ReluSquaredMLP(hidden, intermediate, bool(cfg.get("mlp_bias", False)))

    def remap_weight_name(self, name: str) -> str | None:
        """``backbone.{embeddings, layers, norm_f}`` -> ``model.{embed_tokens, layers, norm}``."""
        if name.startswith("mtp."):
            return None
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        if name.startswith("model.embeddings."):
            return "model.embed_tokens." + name.removeprefix("model.embeddings.")
        if name.startswith("model.norm_f."):
            return "model.norm." + name.removeprefix("model.norm_f.")
        return name

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Router correction biases are fp32 buffers: copy them aside, the rest by name."""
        buffers = dict(self.named_buffers())

        def parameters_only() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                target = self.remap_weight_name(name)
                if target is not None and target.endswith("e_score_correction_bias"):
                    buffers[target].copy_(tensor.float())
                else:
                    yield name, tensor

        super().load_weights(parameters_only())
