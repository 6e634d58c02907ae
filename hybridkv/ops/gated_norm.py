"""The gated RMSNorm of Gated DeltaNet outputs, as one function of plain tensors.

The layer (:class:`hybridkv.layers.norm.GatedRMSNorm`) and the fused decode step of the
GDN mixer (:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`) both compute it; one
formula keeps their roundings the same.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * norm(x) * silu(gate)`` over the last dim, in ``x``'s dtype, rounded where
    FLA's ``FusedRMSNormGated`` (Qwen3-Next's transformers path) rounds: the normalised
    values to ``x``'s dtype before the weight, the product after the gate."""
    normed = weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)
