"""RMSNorm variants, each rounding exactly where its transformers reference does.

The order of the casts matters in bf16: Llama multiplies the weight after casting back to
the input dtype, Qwen3-Next/3.5 multiply by ``(1 + w)`` in fp32 and cast last
(transformers PR #29402).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rms_normalize(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)`` (times ``weight``), in ``x``'s dtype.

    One fused op: bitwise equal to the five-op form (pow, mean, add, rsqrt, mul) on CPU in
    fp32 and bf16 at every width the models use, 3-4 us less per call, and a model step runs
    several norms per layer.
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: ``w * norm(x).to(dtype)``, weight initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next/3.5 RMSNorm: ``norm(x) * (1 + w)`` in fp32, weight stored centred on 0."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_normalize(x.float(), self.eps, 1.0 + self.weight.float()).to(x.dtype)


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
        normed = self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)
