"""Mamba2 SSD in plain torch: chunked scan for prefill, one-step recurrence for decode.

The SSM per head ``h`` (state ``[head_dim, d_state]``), with ``dt`` after bias, softplus
and clamp, and ``B``/``C`` shared by the ``num_heads // n_groups`` heads of a group::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t       # [P, N]
    y_t = h_t @ C_t + D * x_t                               # [P]

The scan is the SSD block decomposition of transformers' ``torch_forward`` (Bamba,
NemotronH, GraniteMoeHybrid), for one sequence without a batch dimension, so a prefill
chunk resumes from the state an earlier chunk or a snapshot left. All math runs in fp32;
the state comes back in fp32 and the caller casts it to the page's dtype.

The clamp ``dt_limit`` applies in both paths. transformers' decode step skips it
(as does mamba_ssm's ``selective_state_update``), which would make a token computed by
a one-token prefill chunk differ from the same token computed by a decode step; with the
default limits ``(0, inf)`` after softplus the clamp is a no-op either way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DtLimit = tuple[float, float]
NO_DT_LIMIT: DtLimit = (0.0, math.inf)


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: DtLimit
) -> torch.Tensor:
    """Raw ``dt`` projection → step size: ``clamp(softplus(dt + bias))`` in fp32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, else ``-inf``.

    Masked cumulative sums instead of differences of a cumsum: the same stable form
    transformers uses, so the two agree to the last bits.
    """
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)  # [..., size(i), size(j)] = x[..., i]
    strict = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0)
    sums = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~lower, -math.inf)


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of ``chunk_size`` and split it: [T, ...] → [c, L, ...]."""
    pad = (-x.shape[0]) % chunk_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.reshape(-1, chunk_size, *x.shape[1:])


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the SSM over one sequence from ``initial_state`` (zeros when None).

    Args:
        x: ``[T, H, P]`` inputs after the conv. dt: ``[T, H]`` raw (before bias/softplus).
        A: ``[H]`` (negative). B, C: ``[T, G, N]`` with ``H % G == 0``.
        D: ``[H]`` skip. initial_state: ``[H, P, N]``.

    Returns:
        ``(y [T, H, P] in x's dtype, final_state [H, P, N] in fp32)``.
    """
    seq_len, num_heads, head_dim = x.shape
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    xf = x.float()
    heads_per_group = num_heads // B.shape[1]
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # [T, H, N]
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)  # [T, H, N]
    x_dt = _chunks(xf * dt[..., None], chunk_size)  # [c, L, H, P]
    A_dt = _chunks(A.float()[None, :] * dt, chunk_size).permute(2, 0, 1)  # [H, c, L]
    Bh, Ch = _chunks(Bh, chunk_size), _chunks(Ch, chunk_size)  # [c, L, H, N]
    A_cum = torch.cumsum(A_dt, dim=-1)  # [H, c, L]

    # 1. inside each chunk: attention-like, scores C_l·B_s decayed from s to l
    decay = torch.exp(segment_sum(A_dt))  # [H, c, L(l), L(s)]
    scores = torch.einsum("clhn,cshn->clsh", Ch, Bh) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x_dt)  # [c, L, H, P]

    # 2. the state each chunk adds by its end, from a zero start
    decay_to_end = torch.exp(A_cum[..., -1:] - A_cum)  # [H, c, L]
    B_decay = Bh * decay_to_end.permute(1, 2, 0)[..., None]  # [c, L, H, N]
    chunk_states = torch.einsum("clhn,clhp->chpn", B_decay, x_dt)  # [c, H, P, N]

    # 3. carry states across chunks: the start state of every chunk, and the final one
    start = (
        initial_state.float()[None]
        if initial_state is not None
        else chunk_states.new_zeros(1, num_heads, head_dim, Bh.shape[-1])
    )
    chunk_states = torch.cat([start, chunk_states])  # [c+1, H, P, N]
    chunk_decay = torch.exp(segment_sum(F.pad(A_cum[..., -1], (1, 0))))  # [H, c+1, c+1]
    states = torch.einsum("hcz,zhpn->chpn", chunk_decay, chunk_states)  # [c+1, H, P, N]

    # 4. what the start state of each chunk contributes to its outputs
    y_off = torch.einsum("clhn,chpn->clhp", Ch, states[:-1])
    y_off = y_off * torch.exp(A_cum).permute(1, 2, 0)[..., None]  # [c, L, H, P]

    y = (y_diag + y_off).reshape(-1, num_heads, head_dim)[:seq_len]  # [T, H, P]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), states[-1]


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token for each of ``num_seqs`` sequences; updates ``state`` in place.

    Args:
        state: ``[S, H, P, N]``, any float dtype; row ``state_indices[i]`` belongs to
            sequence ``i`` (rows ``0..num_seqs-1`` when ``state_indices`` is None).
        x: ``[num_seqs, H, P]``. dt: ``[num_seqs, H]`` raw. B, C: ``[num_seqs, G, N]``.

    Returns:
        ``y [num_seqs, H, P]`` in x's dtype.
    """
    num_seqs, num_heads, _ = x.shape
    rows = state_indices if state_indices is not None else torch.arange(num_seqs)
    rows = rows.to(state.device)
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [S', H]
    heads_per_group = num_heads // B.shape[1]
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # [S', H, N]
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)  # [S', H, N]
    xf = x.float()
    decay = torch.exp(dt * A.float())  # [S', H]
    h = state[rows].float() * decay[..., None, None]  # [S', H, P, N]
    h = h + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    state.index_copy_(0, rows, h.to(state.dtype))
    y = torch.einsum("shpn,shn->shp", h, Ch)  # [S', H, P]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)
