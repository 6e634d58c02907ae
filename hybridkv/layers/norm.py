"""RMSNorm variants, each rounding exactly where its transformers reference does.

The order of the casts matters in bf16: Llama multiplies the weight after casting back to
the input dtype, Qwen3-Next/3.5 multiply by ``(1 + w)`` in fp32 and cast last
(transformers PR #29402).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.ops.gated_norm import gated_rms_norm
from hybridkv.ops.row_blocks import by_row_blocks


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
        return by_row_blocks(self._norm, x)

    def _norm(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next/3.5 RMSNorm: ``norm(x) * (1 + w)`` in fp32, weight stored centred on 0."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        # (the weight it was computed from, its storage, version, dtype, device), 1 + w
        self._scale: tuple[tuple[Any, ...], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        return by_row_blocks(self._norm, x)

    def _norm(self, x: Tensor) -> Tensor:
        return rms_normalize(x.float(), self.eps, self.scale()).to(x.dtype)

    def scale(self) -> Tensor:
        """``1 + w`` in fp32, computed once per weight while no graph is recorded: a step
        runs a dozen of these norms or more, and the two ops each saved are a visible share
        of a small model's step. Recomputed when the weight changes (loaded, moved, cast or
        updated in place or replaced: the object, its storage, dtype, device or version
        differ)."""
        weight = self.weight
        if weight.requires_grad and torch.is_grad_enabled():
            return 1.0 + weight.float()
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        cached = self._scale
        if cached is None or cached[0][0] is not weight or cached[0][1:] != key:
            with torch.inference_mode(False), torch.no_grad():
                self._scale = ((weight, *key), 1.0 + weight.float())
        assert self._scale is not None
        return self._scale[1]


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
        return by_row_blocks(self._norm, x, gate)

    def _norm(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
