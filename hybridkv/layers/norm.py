"""RMSNorm variants, each rounding exactly where its transformers reference does.

The order of the casts matters in bf16: Llama multiplies the weight after casting back to
the input dtype, Qwen3-Next/3.5 multiply by ``(1 + w)`` in fp32 and cast last
(transformers PR #29402).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: ``w * norm(x).to(dtype)``, weight initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * _rms(x.float(), self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next/3.5 RMSNorm: ``norm(x) * (1 + w)`` in fp32, weight stored centred on 0."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return (_rms(x.float(), self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Norm-then-gate RMSNorm of GDN outputs: ``w * norm(x) * silu(gate)`` per head.

    Norms over the last dim (one head), which is what FLA's ``FusedRMSNormGated`` does for
    Qwen3-Next; Mamba2's grouped variant normalises over ``group_size`` channels instead.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = self.weight * _rms(x.float(), self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)
