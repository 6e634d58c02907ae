"""Feed-forward blocks: gated (SwiGLU) MLP and a top-k mixture of experts.

Expert weights live as one :class:`GatedMLP` per expert, named like the checkpoints
(``experts.N.{gate,up,down}_proj.weight``); transformers 5 fuses them only in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The functional for an HF ``hidden_act`` name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}") from None


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Softmax top-k router over experts, plus an optional sigmoid-gated shared expert.

    Qwen3-Next / Qwen3.5-MoE: ``out = sum_k p_k expert_k(x) + sigmoid(g(x)) * shared(x)``,
    the top-k probabilities renormalised when ``norm_topk_prob``.
    """

    def __init__(
        self,
        hidden: int,
        moe_intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        shared_intermediate: int = 0,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe_intermediate, act) for _ in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate > 0:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return top_p.to(logits.dtype), top_i

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(x)  # [T, k]
        out = torch.zeros_like(x)
        for expert_id in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert_id)
            y = self.experts[expert_id](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
