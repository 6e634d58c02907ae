"""Reference depthwise causal conv1d with a carried state (GDN, Mamba1/2, short conv).

State contract (shared by every recurrent layer that convolves its input):
``conv_state`` is ``[C, K-1]``, channels first: the last ``K-1`` *inputs* of the sequence
(before the conv and the activation), oldest first, zero-padded on the left while the
sequence is shorter than ``K-1``. A fresh sequence starts from zeros, which equals the
zero padding of an uncached ``conv1d(padding=K-1)``. Tokens are rows: ``x`` is ``[n, C]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def activate(x: Tensor, activation: str | None) -> Tensor:
    """The conv's activation: None or silu."""
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Convolve one sequence chunk that continues from ``initial_state``.

    Args:
        x: [n, C] inputs of this chunk.
        weight: [C, K] depthwise taps; bias: [C] or None.
        initial_state: [C, K-1] last inputs before this chunk, or None for zeros.
        activation: None or "silu".

    Returns:
        (out [n, C] in x's dtype, final_state [C, K-1] in the weight dtype)
    """
    channels, kernel = weight.shape
    xc = x.transpose(0, 1).to(weight.dtype)  # [C, n]
    if initial_state is None:
        initial_state = xc.new_zeros(channels, kernel - 1)
    full = torch.cat([initial_state.to(weight.dtype), xc], dim=-1)  # [C, K-1+n]
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=channels)[0]  # [C, n]
    final_state = full[:, full.shape[-1] - (kernel - 1) :]  # [C, K-1]
    return activate(out, activation).transpose(0, 1).to(x.dtype), final_state


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = None,
) -> Tensor:
    """One decode step for a batch: shift each state left by one input, in place.

    Args:
        x: [B, C] one new input per sequence.
        conv_state: [B, C, K-1], updated in place.
        weight: [C, K]; bias: [C] or None.

    Returns:
        [B, C] in x's dtype.
    """
    full = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)
    out = (full * weight[None]).sum(-1)  # [B, C]
    if bias is not None:
        out = out + bias
    conv_state.copy_(full[:, :, 1:])
    return activate(out, activation).to(x.dtype)
