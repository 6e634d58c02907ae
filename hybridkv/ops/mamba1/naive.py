"""Mamba1 selective scan in plain torch: prefill from a carried state, and one decode step.

Per channel ``d`` of ``d_inner`` (state ``[d_state]``), with ``dt`` after bias and softplus::

    h_t = exp(dt_t * A[d]) * h_{t-1} + dt_t * x_t * B_t     # [N]
    y_t = (h_t · C_t + D[d] * x_t) * silu(z_t)

Unlike Mamba2, ``A`` is a full ``[d_inner, d_state]`` matrix and ``dt`` is per channel, so
there is no cheap chunked closed form; the scan is the token loop, vectorised over
channels and run in slices of ``slice_tokens`` to bound the ``[T, d_inner, d_state]``
temporaries. transformers' own scan restarts from zeros on every call (its chunked
prefill on a cache is wrong for Mamba1, see notes/transformers-reference-on-cpu.md,
pitfall 4); this one starts from ``initial_state``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """Raw ``dt`` projection -> step size ``softplus(dt + bias)`` in fp32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def gate_output(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """Skip connection and gate, in fp32: ``(y + D x) * silu(z)``."""
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    initial_state: torch.Tensor | None = None,
    slice_tokens: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the selective SSM over one sequence from ``initial_state`` (zeros when None).

    Args:
        x, dt, z: ``[T, d_inner]`` (dt raw, before bias/softplus).
        A: ``[d_inner, N]`` (negative). B, C: ``[T, N]``. D, dt_bias: ``[d_inner]``.
        initial_state: ``[d_inner, N]``.

    Returns:
        ``(y [T, d_inner] in x's dtype, final_state [d_inner, N] in fp32)``.
    """
    seq_len, d_inner = x.shape
    dt = discretize(dt, dt_bias, dt_softplus)  # [T, Di]
    Af = A.float()
    h = (
        initial_state.float().clone()
        if initial_state is not None
        else x.new_zeros(d_inner, A.shape[-1], dtype=torch.float32)
    )
    ys: list[torch.Tensor] = []
    for start in range(0, seq_len, slice_tokens):
        part = slice(start, min(start + slice_tokens, seq_len))
        decay = torch.exp(dt[part, :, None] * Af)  # [t, Di, N]
        inject = (dt[part] * x[part].float())[..., None] * B[part, None, :].float()  # [t, Di, N]
        states = torch.empty_like(decay)  # [t, Di, N]
        for i in range(decay.shape[0]):
            h = decay[i] * h + inject[i]
            states[i] = h
        ys.append(torch.einsum("tdn,tn->td", states, C[part].float()))  # [t, Di]
    y = torch.cat(ys) if ys else x.new_zeros(0, d_inner, dtype=torch.float32)
    return gate_output(y, x, D, z), h


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token for each of ``num_seqs`` sequences; updates ``state`` in place.

    Args:
        state: ``[S, d_inner, N]``, any float dtype; row ``state_indices[i]`` belongs to
            sequence ``i`` (rows ``0..num_seqs-1`` when ``state_indices`` is None).
        x, dt, z: ``[num_seqs, d_inner]``. B, C: ``[num_seqs, N]``.

    Returns:
        ``y [num_seqs, d_inner]`` in x's dtype.
    """
    num_seqs = x.shape[0]
    rows = state_indices if state_indices is not None else torch.arange(num_seqs)
    rows = rows.to(state.device)
    dt = discretize(dt, dt_bias, dt_softplus)  # [S', Di]
    decay = torch.exp(dt[..., None] * A.float())  # [S', Di, N]
    inject = (dt * x.float())[..., None] * B.float()[:, None, :]  # [S', Di, N]
    h = state[rows].float() * decay + inject  # [S', Di, N]
    state.index_copy_(0, rows, h.to(state.dtype))
    y = torch.einsum("sdn,sn->sd", h, C.float())  # [S', Di]
    return gate_output(y, x, D, z)
